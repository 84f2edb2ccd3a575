import { strict as assert } from "node:assert";
import { commandArguments, executeCommandMiddleware } from "../src/commands";
import { schema, type CommandSpec, type Stats } from "../src/protocol";
import { serverSettings } from "../src/settings";
import { statsText } from "../src/status";
import { fakeEditor } from "./helpers";

const byId = (id: string): CommandSpec => schema.commands.find((command) => command.id === id)!;
const prompted = schema.commands.find((command) => command.prompt)!;
const unprompted = schema.commands.find((command) => !command.prompt)!;
const text = "def add(a, b):\n    return a + b\n";

describe("commandArguments", () => {
  it("sends the selection as an LSP range", async () => {
    const args = await commandArguments(unprompted, fakeEditor(text, [0, 4], [1, 16]), async () => undefined);
    assert.deepEqual(args, {
      uri: "file:///work/example.py",
      range: { start: { line: 0, character: 4 }, end: { line: 1, character: 16 } },
    });
  });

  it("takes the whole document when nothing is selected", async () => {
    const args = await commandArguments(unprompted, fakeEditor(text, [1, 2], [1, 2]), async () => undefined);
    assert.deepEqual(args!.range, { start: { line: 0, character: 0 }, end: { line: 2, character: 0 } });
  });

  it("asks with the schema's prompt for the last argument", async () => {
    const asked: string[] = [];
    const args = await commandArguments(prompted, fakeEditor(text, [0, 0], [1, 0]), async (prompt) => {
      asked.push(prompt);
      return "use f-strings";
    });
    assert.deepEqual(asked, [prompted.prompt]);
    assert.equal(args![prompted.arguments[prompted.arguments.length - 1].name], "use f-strings");
    assert.deepEqual(Object.keys(args!), prompted.arguments.map((argument) => argument.name));
  });

  it("gives up when the prompt is cancelled or empty", async () => {
    const editor = fakeEditor(text, [0, 0], [1, 0]);
    assert.equal(await commandArguments(prompted, editor, async () => undefined), undefined);
    assert.equal(await commandArguments(prompted, editor, async () => ""), undefined);
  });

  it("says what to do without an editor", async () => {
    await assert.rejects(commandArguments(unprompted, undefined, async () => undefined), /select some code/);
  });
});

describe("executeCommandMiddleware", () => {
  const calls: [string, unknown[]][] = [];
  const next = (id: string, args: unknown[]) => {
    calls.push([id, args]);
    return "sent";
  };
  beforeEach(() => (calls.length = 0));

  it("fills in the arguments of a command run from the palette", async () => {
    const run = executeCommandMiddleware(schema, () => fakeEditor(text, [0, 0], [0, 3]), async () => "x");
    assert.equal(await run(prompted.id, [], next), "sent");
    assert.equal(calls.length, 1);
    assert.equal(calls[0][0], prompted.id);
    assert.equal((calls[0][1][0] as any).range.end.character, 3);
  });

  it("passes a code action's own arguments and other commands through", async () => {
    const run = executeCommandMiddleware(schema, () => undefined, async () => "x");
    const own = [{ uri: "file:///a", range: {} }];
    await run(byId(unprompted.id).id, own, next);
    await run("other.command", [], next);
    assert.deepEqual(calls, [[unprompted.id, own], ["other.command", []]]);
  });

  it("sends nothing when the prompt is cancelled", async () => {
    const run = executeCommandMiddleware(schema, () => fakeEditor(text, [0, 0], [0, 3]), async () => undefined);
    assert.equal(await run(prompted.id, [], next), undefined);
    assert.equal(calls.length, 0);
  });
});

describe("serverSettings", () => {
  it("is every schema setting, configured or default, and nothing else", () => {
    const configured: Record<string, unknown> = { max_tokens: 32, serverCommand: "/opt/codespec" };
    const settings = serverSettings({ get: <T>(name: string) => configured[name] as T | undefined }, schema);
    assert.deepEqual(Object.keys(settings), schema.settings.map((setting) => setting.name));
    for (const setting of schema.settings) {
      assert.deepEqual(settings[setting.name], setting.name === "max_tokens" ? 32 : setting.default);
    }
  });
});

describe("statsText", () => {
  it("shows tokens per second and acceptance", () => {
    const stats: Stats = { kind: "completion", generated_tokens: 57, tokens_per_second: 41.6, tokens_per_forward: 2.345, acceptance: 0.784 };
    const { text: shown, tooltip } = statsText(stats);
    assert.equal(shown, "$(sparkle) 42 tok/s · 78% acc");
    assert.match(tooltip, /57 tokens at 41\.6 tok\/s, 2\.35 tokens per forward, 78% of drafted tokens accepted/);
  });

  it("keeps one decimal below 10 tok/s, so a slow machine does not read 0 tok/s", () => {
    const stats: Stats = { kind: "completion", generated_tokens: 8, tokens_per_second: 0.25, tokens_per_forward: 1, acceptance: 0 };
    assert.equal(statsText(stats).text, "$(sparkle) 0.3 tok/s · 0% acc");
    assert.equal(statsText({ ...stats, tokens_per_second: 9.96 }).text, "$(sparkle) 10 tok/s · 0% acc");
    assert.equal(statsText({ ...stats, tokens_per_second: 9.94 }).text, "$(sparkle) 9.9 tok/s · 0% acc");
  });
});
