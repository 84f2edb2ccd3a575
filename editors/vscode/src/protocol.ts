// Typed access to the protocol schema (editors/protocol.json, generated from lsp/protocol.py and copied
// next to this file by `npm run sync-protocol`): nothing in the extension spells a command id or method.
import schemaJson from "./protocol.json";

export interface ArgumentSpec {
  name: string;
  type: string;
  doc: string;
}

export interface CommandSpec {
  id: string;
  title: string;
  prompt: string | null; // ask the user for the last argument with this prompt
  arguments: ArgumentSpec[];
}

export interface SettingSpec {
  name: string;
  type: string; // JSON type: "string", "integer", "number", "boolean", "array"
  default: unknown;
}

export interface ProtocolSchema {
  server: string;
  settingsSection: string;
  commands: CommandSpec[];
  notifications: { stats: { method: string; params: string[] } };
  settings: SettingSpec[];
}

/** Params of the stats notification. */
export interface Stats {
  kind: string;
  generated_tokens: number;
  tokens_per_second: number;
  tokens_per_forward: number;
  acceptance: number;
}

// The stats fields the status bar reads; a test checks each is in the schema.
export const STATS_FIELDS: (keyof Stats)[] = [
  "kind",
  "generated_tokens",
  "tokens_per_second",
  "tokens_per_forward",
  "acceptance",
];

export const schema: ProtocolSchema = schemaJson as ProtocolSchema;

/** The argument the user is asked for, when the command has a prompt. */
export function promptedArgument(command: CommandSpec): string | undefined {
  return command.prompt ? command.arguments[command.arguments.length - 1].name : undefined;
}
