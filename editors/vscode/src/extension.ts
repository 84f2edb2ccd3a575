// Wiring only: the language client, the status bar item and configuration changes. The logic lives in
// small modules that the unit tests drive with a mocked `vscode`.
import * as vscode from "vscode";
import {
  DidChangeConfigurationNotification,
  ExecuteCommandRequest,
  LanguageClient,
  type LanguageClientOptions,
} from "vscode-languageclient/node";
import { executeCommandMiddleware } from "./commands";
import { schema, type Stats } from "./protocol";
import { serverSettings } from "./settings";
import { IDLE_TEXT, statsText } from "./status";

let client: LanguageClient | undefined;

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  const section = schema.settingsSection;
  const configuration = () => vscode.workspace.getConfiguration(section);
  const settings = () => ({ [section]: serverSettings(configuration(), schema) });
  const ask = (prompt: string) => vscode.window.showInputBox({ prompt, ignoreFocusOut: true });
  const runCommand = executeCommandMiddleware(schema, () => vscode.window.activeTextEditor, ask);

  const status = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
  status.text = IDLE_TEXT;
  status.tooltip = "codespec: no completion yet";
  status.show();
  context.subscriptions.push(status);

  const clientOptions: LanguageClientOptions = {
    documentSelector: [{ scheme: "file" }, { scheme: "untitled" }],
    initializationOptions: settings(),
    middleware: {
      executeCommand: runCommand,
      workspace: {
        // Answer workspace/configuration with the server's settings only (not the client's own).
        configuration: async (params, token, next) => {
          const answers = await next(params, token);
          return Array.isArray(answers)
            ? params.items.map((item, i) => (item.section === section ? settings()[section] : answers[i]))
            : answers;
        },
      },
    },
  };
  client = new LanguageClient(
    schema.server,
    "codespec",
    { command: configuration().get<string>("serverCommand", "codespec"), args: configuration().get<string[]>("serverArgs", ["lsp"]) },
    clientOptions,
  );
  context.subscriptions.push(
    client.onNotification(schema.notifications.stats.method, (stats: Stats) => {
      ({ text: status.text, tooltip: status.tooltip } = statsText(stats));
    }),
  );

  try {
    await client.start();
  } catch (error) {
    void vscode.window.showErrorMessage(
      `codespec: could not start the language server (${error}). Set codespec.serverCommand to the codespec executable.`,
    );
    return;
  }

  // vscode-languageclient registers the commands the server advertises; register any it did not.
  const advertised = new Set(client.initializeResult?.capabilities.executeCommandProvider?.commands ?? []);
  for (const command of schema.commands.filter((command) => !advertised.has(command.id))) {
    context.subscriptions.push(
      vscode.commands.registerCommand(command.id, (...args: unknown[]) =>
        runCommand(command.id, args, (id, resolved) =>
          client!.sendRequest(ExecuteCommandRequest.type, { command: id, arguments: resolved }),
        ),
      ),
    );
  }

  context.subscriptions.push(
    vscode.workspace.onDidChangeConfiguration((event) => {
      if (event.affectsConfiguration(section)) {
        void client?.sendNotification(DidChangeConfigurationNotification.type, { settings: settings() });
      }
    }),
  );
}

export function deactivate(): Thenable<void> | undefined {
  return client?.stop();
}
