// The extension and its manifest against the protocol schema: a disagreement fails here.
import { strict as assert } from "node:assert";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { clientSettings, manifestContributions } from "../src/manifest";
import { schema, STATS_FIELDS, type ProtocolSchema } from "../src/protocol";

const root = join(__dirname, "..", "..");
const readJson = (path: string) => JSON.parse(readFileSync(path, "utf8"));

describe("protocol schema", () => {
  it("is the copy of editors/protocol.json the build compiled in", () => {
    assert.deepEqual(schema, readJson(join(root, "..", "protocol.json")));
  });

  it("matches package.json's commands, menus and settings (run `npm run update-manifest` after a schema change)", () => {
    const manifest = readJson(join(root, "package.json"));
    const existing = manifest.contributes.configuration.properties;
    assert.deepEqual(manifest.contributes, manifestContributions(schema, existing, clientSettings));
  });

  it("has every stats field the status bar reads", () => {
    for (const field of STATS_FIELDS) {
      assert.ok(schema.notifications.stats.params.includes(field), `stats lacks ${field}`);
    }
  });

  it("keeps the extension's own settings apart from the server's", () => {
    const names = new Set(schema.settings.map((setting) => setting.name));
    for (const setting of clientSettings) {
      assert.ok(!names.has(setting.name), `${setting.name} is also a server setting`);
    }
  });
});

describe("manifestContributions", () => {
  const tiny: ProtocolSchema = {
    server: "codespec",
    settingsSection: "codespec",
    commands: [{ id: "codespec.x", title: "codespec: x", prompt: null, arguments: [] }],
    notifications: { stats: { method: "codespec/stats", params: [] } },
    settings: [{ name: "spec", type: "array", default: ["a"] }],
  };

  it("follows a renamed command and a changed default", () => {
    const contributions = manifestContributions(tiny, {}, []);
    assert.deepEqual(contributions.commands, [{ command: "codespec.x", title: "codespec: x" }]);
    assert.deepEqual(contributions.configuration.properties["codespec.spec"], {
      type: "array", default: ["a"], items: { type: "string" }, description: "Server setting spec.",
    });
  });

  it("keeps a description written in package.json", () => {
    const existing = { "codespec.spec": { type: "array", default: [], description: "drafters" } };
    assert.equal(manifestContributions(tiny, existing, []).configuration.properties["codespec.spec"].description, "drafters");
  });
});
