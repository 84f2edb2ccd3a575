import type { EditorLike } from "../src/commands";

/** An editor on `text` with the selection from (line, character) to (line, character). */
export function fakeEditor(text: string, start: [number, number], end: [number, number]): EditorLike {
  const lines = text.split("\n");
  return {
    document: {
      uri: { toString: () => "file:///work/example.py" },
      lineCount: lines.length,
      lineAt: (line: number) => ({ text: lines[line] }),
    },
    selection: {
      start: { line: start[0], character: start[1] },
      end: { line: end[0], character: end[1] },
      isEmpty: start[0] === end[0] && start[1] === end[1],
    },
  };
}
