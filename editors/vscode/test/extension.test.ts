// activate() with a mocked vscode and language client: what the extension wires up.
import { state, reset } from "./mock-vscode"; // first: installs the mocks before extension.ts loads
import { strict as assert } from "node:assert";
import { schema } from "../src/protocol";
import { fakeEditor } from "./helpers";

// eslint-disable-next-line @typescript-eslint/no-require-imports
const extension: typeof import("../src/extension") = require("../src/extension");

const context = () => ({ subscriptions: [] as { dispose(): void }[] }) as any;
const section = schema.settingsSection;

describe("activate", () => {
  beforeEach(reset);

  it("starts `codespec lsp` with the configured server settings", async () => {
    state.configuration = { [`${section}.max_tokens`]: 48, [`${section}.serverCommand`]: "/venv/bin/codespec" };
    await extension.activate(context());
    const [client] = state.clients;
    assert.equal(client.id, schema.server);
    assert.deepEqual(client.serverOptions, { command: "/venv/bin/codespec", args: ["lsp"] });
    const settings = client.clientOptions.initializationOptions[section];
    assert.equal(settings.max_tokens, 48);
    assert.equal(settings.serverCommand, undefined);
    assert.ok(client.started);
  });

  it("shows the stats notification in the status bar", async () => {
    await extension.activate(context());
    const [status] = state.statusItems;
    assert.ok(status.shown);
    const onStats = state.clients[0].notificationHandlers.get(schema.notifications.stats.method)!;
    onStats({ kind: "completion", generated_tokens: 10, tokens_per_second: 55.2, tokens_per_forward: 3, acceptance: 0.5 });
    assert.equal(status.text, "$(sparkle) 55 tok/s · 50% acc");
    assert.match(status.tooltip, /10 tokens/);
  });

  it("registers the commands the server did not advertise, asking with the schema's prompt", async () => {
    const prompted = schema.commands.find((command) => command.prompt)!;
    state.advertisedCommands = schema.commands.filter((command) => command !== prompted).map((command) => command.id);
    await extension.activate(context());
    assert.deepEqual([...state.commands.keys()], [prompted.id]);

    state.activeTextEditor = fakeEditor("x = 1\ny = 2\n", [1, 0], [1, 5]);
    state.inputBoxAnswers = ["rename y to z"];
    await state.commands.get(prompted.id)!();
    assert.deepEqual(state.prompts, [prompted.prompt]);
    const [request] = state.clients[0].requests;
    assert.equal(request.type, "workspace/executeCommand");
    const params = request.params as { command: string; arguments: Record<string, unknown>[] };
    assert.equal(params.command, prompted.id);
    assert.deepEqual(params.arguments[0].range, { start: { line: 1, character: 0 }, end: { line: 1, character: 5 } });
  });

  it("leaves advertised commands to vscode-languageclient, which runs them through the middleware", async () => {
    state.advertisedCommands = schema.commands.map((command) => command.id);
    await extension.activate(context());
    assert.equal(state.commands.size, 0);
    const middleware = state.clients[0].clientOptions.middleware;
    state.activeTextEditor = fakeEditor("x = 1\n", [0, 0], [0, 5]);
    const unprompted = schema.commands.find((command) => !command.prompt)!;
    const sent = await middleware.executeCommand(unprompted.id, [], (id: string, args: unknown[]) => ({ id, args }));
    assert.equal(sent.id, unprompted.id);
    assert.equal(sent.args[0].uri, "file:///work/example.py");
  });

  it("sends changed settings to the server and answers workspace/configuration with them", async () => {
    await extension.activate(context());
    state.configuration = { [`${section}.draft_max`]: 4 };
    state.configurationListeners[0]({ affectsConfiguration: (name) => name === section });
    state.configurationListeners[0]({ affectsConfiguration: () => false });
    const [sent] = state.clients[0].sent;
    assert.equal(state.clients[0].sent.length, 1);
    assert.equal((sent.params as any).settings[section].draft_max, 4);

    const configuration = state.clients[0].clientOptions.middleware.workspace.configuration;
    const answers = await configuration({ items: [{ section }, { section: "editor" }] }, undefined, async () => [{ all: 1 }, { tabSize: 4 }]);
    assert.equal(answers[0].draft_max, 4);
    assert.equal(answers[0].all, undefined);
    assert.deepEqual(answers[1], { tabSize: 4 });
  });

  it("says how to fix a server that does not start", async () => {
    state.startError = new Error("spawn codespec ENOENT");
    await extension.activate(context());
    assert.equal(state.errors.length, 1);
    assert.match(state.errors[0], /ENOENT.*codespec\.serverCommand/);
  });
});
