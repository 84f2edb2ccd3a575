"""Context from other files: chunks of the other open and recently edited files, the ones most like the
code around the cursor, within a token budget.

As in llama.vim's ring buffer of chunks, files are cut into fixed runs of lines and scored by how many
identifiers they share with the cursor's surroundings (Jaccard). The chosen chunks go into the prompt in
a stable order (by file, the most recently edited last, then by position in the file), so the next
keystroke's prompt starts with the same tokens and the session's KV cache covers them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")  # shorter names (i, x, id) say little


@dataclass(frozen=True)
class ExtraChunk:
    filename: str
    text: str
    start_line: int  # 0-based


def identifiers(text: str) -> frozenset[str]:
    return frozenset(IDENTIFIER.findall(text))


def split_chunks(text: str, lines_per_chunk: int = 32) -> list[tuple[int, str]]:
    """(start line, text) runs of lines; runs with no code (blank lines only) are dropped."""
    lines = text.splitlines(keepends=True)
    runs = []
    for start in range(0, len(lines), lines_per_chunk):
        chunk = "".join(lines[start : start + lines_per_chunk])
        if chunk.strip():
            runs.append((start, chunk))
    return runs


def similarity(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def pick_chunks(files: Iterable[tuple[str, str]], query: str, budget_tokens: int,
                count_tokens: Callable[[str], int], lines_per_chunk: int = 32,
                max_chars_per_file: int = 1 << 20) -> list[ExtraChunk]:
    """The chunks of `files` ((filename, text), most relevant file first) most similar to `query` (sharing at
    least one identifier with it), as many as fit in `budget_tokens`, returned with the most relevant file
    last and each file's chunks in line order. Files longer than max_chars_per_file are skipped (a generated
    or minified file is rarely the context a completion needs)."""
    if budget_tokens <= 0:
        return []
    wanted = identifiers(query)
    candidates = []  # (score, file rank, start line, filename, text)
    for rank, (filename, text) in enumerate(files):
        if len(text) > max_chars_per_file:
            continue
        for start, chunk in split_chunks(text, lines_per_chunk):
            candidates.append((similarity(wanted, identifiers(chunk)), rank, start, filename, chunk))
    # best first; ties go to the more recent file and the earlier chunk
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    chosen, used = [], 0
    for score, rank, start, filename, chunk in candidates:
        if score == 0:
            break  # nothing in common with the cursor's code: not worth its prefill
        if used + len(chunk) // 8 > budget_tokens:  # cheap lower bound first: tokens are rarely > 8 chars
            continue
        tokens = count_tokens(chunk)
        if used + tokens > budget_tokens:
            continue
        chosen.append((rank, start, ExtraChunk(filename, chunk, start)))
        used += tokens
        if budget_tokens - used < 16:
            break
    # the most relevant file last, nearest the cursor (as fim_prompt expects); lines in file order
    return [chunk for _, _, chunk in sorted(chosen, key=lambda c: (-c[0], c[1]))]
