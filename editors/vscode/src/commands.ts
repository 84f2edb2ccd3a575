// The refactoring commands' arguments from the editor: { uri, range, <prompted argument> } as the schema
// describes them. Run from the command palette they come from the selection; from a code action the
// server already supplied them.
import { promptedArgument, type CommandSpec, type ProtocolSchema } from "./protocol";

interface PositionLike {
  line: number;
  character: number; // UTF-16 code units, as in LSP
}

export interface EditorLike {
  document: { uri: { toString(): string }; lineCount: number; lineAt(line: number): { text: string } };
  selection: { start: PositionLike; end: PositionLike; isEmpty: boolean };
}

export type Ask = (prompt: string) => PromiseLike<string | undefined>;

/** The command's single argument object, or undefined when the user cancelled the prompt. */
export async function commandArguments(
  command: CommandSpec,
  editor: EditorLike | undefined,
  ask: Ask,
): Promise<Record<string, unknown> | undefined> {
  if (!editor) {
    throw new Error(`${command.title}: open a file and select some code first`);
  }
  const { document, selection } = editor;
  const last = document.lineCount - 1;
  // No selection: the whole document, as in Neovim without a range.
  const range = selection.isEmpty
    ? { start: { line: 0, character: 0 }, end: { line: last, character: document.lineAt(last).text.length } }
    : {
        start: { line: selection.start.line, character: selection.start.character },
        end: { line: selection.end.line, character: selection.end.character },
      };
  const args: Record<string, unknown> = { uri: document.uri.toString(), range };
  const prompted = promptedArgument(command);
  if (prompted) {
    const answer = await ask(command.prompt!);
    if (!answer) {
      return undefined;
    }
    args[prompted] = answer;
  }
  return args;
}

type Next = (command: string, args: unknown[]) => unknown;

/** vscode-languageclient middleware for workspace/executeCommand: fills in the arguments of a schema
 * command invoked without any (from the palette or a key binding). */
export function executeCommandMiddleware(
  schema: ProtocolSchema,
  activeEditor: () => EditorLike | undefined,
  ask: Ask,
) {
  const byId = new Map(schema.commands.map((command) => [command.id, command]));
  return async (id: string, args: unknown[], next: Next) => {
    const command = byId.get(id);
    if (!command || args.length > 0) {
      return next(id, args);
    }
    const resolved = await commandArguments(command, activeEditor(), ask);
    return resolved === undefined ? undefined : next(id, [resolved]);
  };
}
