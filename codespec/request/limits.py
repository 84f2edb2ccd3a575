"""Where a completion's text ends, besides EOS, n_predict and stop strings (the engine ends those at a token).

Each limit answers two questions about the text so far: `cut(text, final)`, where the text must end (None: not
known yet), and `safe(text)`, how much of it no later cut can take back (it may be streamed). `OutputFilter`
combines any of them, so a streamed answer never sends text that a later cut would take back, and a request stops
paying for tokens as soon as one limit has ended the text. The limits:

- `BlockLimit`: the code left the block (llama.cpp's n_indent for HTTP, tree-sitter's block indent for the LSP);
- `context.fim.SuffixTrimmer`: the text ran into the code after the cursor (a model without FIM tokens);
- `TimeLimit`: llama.cpp's t_max_predict_ms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..context.treesitter import indent_of


@dataclass(frozen=True)
class BlockRule:
    """How `BlockLimit` reads lines. The rule is one ("stop at the first line after the first that is indented less
    than the block"); these are the two places it is read differently."""

    tab_size: int  # a tab advances to the next multiple of this many columns (1: a tab is one column)
    blank_lines_leave: bool  # a blank line is indented by its whitespace only, so it can end the block
    keep_indentation: bool  # the text ends where the dedented line's content starts; else before its line break
    top_level_blank_run: int  # in a block at column 0, this many blank lines in a row end it (0: never)


# llama.cpp's n_indent (/infill, /completion): tabs and spaces are one column each, a blank line ends the block, the
# cut keeps the new line's indentation (llama.vim relies on these exact semantics)
LLAMA_CPP = BlockRule(tab_size=1, blank_lines_leave=True, keep_indentation=True, top_level_blank_run=0)
# an editor's block completion (the LSP): blank lines inside a function are part of it, two in a row end a top-level
# one, and the text ends with the block's last line
EDITOR = BlockRule(tab_size=4, blank_lines_leave=False, keep_indentation=False, top_level_blank_run=2)


class BlockLimit:
    """Stop when the code leaves the block: at the first line after the first indented less than `indent` columns."""

    def __init__(self, indent: int, rule: BlockRule = EDITOR):
        self.indent, self.rule = indent, rule

    def cut(self, text: str, final: bool = False) -> int | None:
        rule, blank_run = self.rule, 0
        start = text.find("\n") + 1
        while start > 0:
            content = start + len(text[start:]) - len(text[start:].lstrip(" \t"))  # where the line's text starts
            if content == len(text) and (not final or rule.blank_lines_leave):
                return None  # only indentation so far: the line may still go either way (llama.cpp: never decided)
            indent = indent_of(text[start:content], rule.tab_size)
            if (content == len(text) or text[content] in "\r\n") and not rule.blank_lines_leave:
                blank_run += 1  # a blank line stays inside the block
                if self.indent == 0 and rule.top_level_blank_run and blank_run >= rule.top_level_blank_run:
                    return start - 1
            elif indent < self.indent:
                return content if rule.keep_indentation else start - 1
            else:
                blank_run = 0
            start = text.find("\n", start) + 1
        return None

    def safe(self, text: str) -> int:
        start = text.rfind("\n") + 1
        if start == 0 or text[start:].strip(" \t"):
            return len(text)  # the first line, or a line whose indentation is known (cut() judged it already)
        return start if self.rule.keep_indentation else start - 1


class TimeLimit:
    """llama.cpp's t_max_predict_ms: once this long has passed since the first text, stop at the next line break
    that comes (llama.cpp: upon the next token holding one). A step may bring several tokens: the text ends after
    that line break and the indentation that follows it (newline tokens usually carry it), not at the
    step's end, so it never ends part-way into a new line."""

    def __init__(self, milliseconds: int):
        self.seconds = milliseconds / 1000.0
        self.first_at: float | None = None
        self.judged = 0  # how much of the text was seen: only line breaks that come after the time count

    def cut(self, text: str, final: bool = False) -> int | None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        start, self.judged = self.judged, len(text)
        if final or time.perf_counter() - self.first_at <= self.seconds:
            return None
        end = text.find("\n", start)
        if end < 0:
            return None
        end += 1
        while end < len(text) and text[end] in " \t":
            end += 1
        return end

    def safe(self, text: str) -> int:
        return len(text)


class OutputFilter:
    """Feeds text through limits; `feed` returns the text to send and whether generation should stop. Once a limit
    ends the text, every limit judges that end as final (the earliest end wins)."""

    def __init__(self, limits=()):
        self.limits = list(limits)
        self.text = ""
        self.sent = 0
        self.stopped = False  # a limit ended the text (llama.cpp's stop type "limit")

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.text += delta
        cuts = [c for c in (limit.cut(self.text) for limit in self.limits) if c is not None]
        if cuts:
            self.stopped = True
            self.text = self.text[: max(min(cuts), self.sent)]
            return self.finish(), True
        safe = min((limit.safe(self.text) for limit in self.limits), default=len(self.text))
        return self._take(safe), False

    def finish(self) -> str:
        """What is left to send once generation has ended."""
        cuts = [c for c in (limit.cut(self.text, final=True) for limit in self.limits) if c is not None]
        if cuts:
            self.stopped = True
        return self._take(min(cuts) if cuts else len(self.text))

    @property
    def final_text(self) -> str:
        return self.text[: self.sent]

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent : end], end
        return delta


def apply_limits(text: str, limits) -> str:
    """The whole text through the limits at once: what a stream of it through OutputFilter sends."""
    out = OutputFilter(limits)
    return out.feed(text)[0] + out.finish()
