// The server's settings as configured in VS Code: every schema setting, with its default where unset.
import type { ProtocolSchema } from "./protocol";

export interface Configuration {
  get<T>(name: string): T | undefined;
}

export function serverSettings(configuration: Configuration, schema: ProtocolSchema): Record<string, unknown> {
  const settings: Record<string, unknown> = {};
  for (const setting of schema.settings) {
    settings[setting.name] = configuration.get(setting.name) ?? setting.default;
  }
  return settings;
}
