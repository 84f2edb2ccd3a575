// The status bar item's text for the server's speculation stats.
import type { Stats } from "./protocol";

export const IDLE_TEXT = "$(sparkle) codespec";

// Whole tokens per second, but one decimal below 10 so that a slow machine shows "0.4 tok/s", not "0 tok/s".
export function rateText(tokensPerSecond: number): string {
  return tokensPerSecond.toFixed(tokensPerSecond < 9.95 ? 1 : 0);
}

export function statsText(stats: Stats): { text: string; tooltip: string } {
  const accepted = Math.round(stats.acceptance * 100);
  return {
    text: `$(sparkle) ${rateText(stats.tokens_per_second)} tok/s · ${accepted}% acc`,
    tooltip:
      `codespec ${stats.kind}: ${stats.generated_tokens} tokens at ${stats.tokens_per_second.toFixed(1)} tok/s, ` +
      `${stats.tokens_per_forward.toFixed(2)} tokens per forward, ${accepted}% of drafted tokens accepted`,
  };
}
