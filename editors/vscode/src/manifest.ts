// package.json's contributed commands, menus and settings as they follow from the protocol schema.
// scripts/update-manifest.mjs writes them; a test checks the committed package.json still matches.
import type { ProtocolSchema } from "./protocol";

export interface ClientSetting {
  name: string;
  type: string;
  default: unknown;
  description: string;
}

// Settings of the extension itself, not sent to the server.
export const clientSettings: ClientSetting[] = [
  {
    name: "serverCommand",
    type: "string",
    default: "codespec",
    description: "The codespec executable: a name on PATH or a full path (e.g. a virtual environment's bin/codespec).",
  },
  {
    name: "serverArgs",
    type: "array",
    default: ["lsp"],
    description: "Arguments that start the language server.",
  },
];

type Properties = Record<string, { type: string; default: unknown; description?: string; items?: { type: string } }>;

function property(type: string, value: unknown, description: string) {
  const items = Array.isArray(value) ? { items: { type: "string" } } : {};
  return { type, default: value, ...items, description };
}

/** The contributes section for the schema; descriptions already in `existing` are kept. */
export function manifestContributions(schema: ProtocolSchema, existing: Properties, client: ClientSetting[]) {
  const section = schema.settingsSection;
  const properties: Properties = {};
  const describe = (key: string, fallback: string) => existing[key]?.description ?? fallback;
  for (const setting of schema.settings) {
    const key = `${section}.${setting.name}`;
    properties[key] = property(setting.type, setting.default, describe(key, `Server setting ${setting.name}.`));
  }
  for (const setting of client) {
    const key = `${section}.${setting.name}`;
    properties[key] = property(setting.type, setting.default, setting.description);
  }
  return {
    commands: schema.commands.map((command) => ({ command: command.id, title: command.title })),
    menus: {
      "editor/context": schema.commands.map((command) => ({
        command: command.id,
        when: "editorHasSelection",
        group: "codespec",
      })),
    },
    configuration: { title: "codespec", properties },
  };
}
