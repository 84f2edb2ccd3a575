// The status bar item's text for the server's speculation stats.
import type { Stats } from "./protocol";

export const IDLE_TEXT = "$(sparkle) codespec";

export function statsText(stats: Stats): { text: string; tooltip: string } {
  const accepted = Math.round(stats.acceptance * 100);
  return {
    text: `$(sparkle) ${stats.tokens_per_second.toFixed(0)} tok/s · ${accepted}% acc`,
    tooltip:
      `codespec ${stats.kind}: ${stats.generated_tokens} tokens at ${stats.tokens_per_second.toFixed(1)} tok/s, ` +
      `${stats.tokens_per_forward.toFixed(2)} tokens per forward, ${accepted}% of drafted tokens accepted`,
  };
}
