"""Where a completion's text ends, besides EOS, length and stop strings (which the engine handles).

Each limit answers two questions about the text so far: `cut(text, final)`, where the text must end (None: not
known yet), and `safe(text)`, how much of it can no longer be cut (it may be streamed). `OutputFilter` combines
them, so a streamed response never sends text that a later cut would take back.
"""

from __future__ import annotations

import time


class IndentLimit:
    """llama.cpp's n_indent: stop at the first line after the first that is indented less than `n_indent` columns
    (spaces and tabs count one each); the text ends where that line's content would start. As in llama.cpp, a blank
    line counts as indented by its whitespace only."""

    def __init__(self, n_indent: int):
        self.n_indent = n_indent

    def cut(self, text: str, final: bool = False) -> int | None:
        start = text.find("\n") + 1
        while start > 0:
            indent = len(text[start:]) - len(text[start:].lstrip(" \t"))
            decided = start + indent < len(text)
            if decided and indent < self.n_indent:
                return start + indent
            if not decided:
                return None
            start = text.find("\n", start) + 1
        return None

    def safe(self, text: str) -> int:
        start = text.rfind("\n") + 1
        if start == 0 or text[start:].strip(" \t"):
            return len(text)  # the first line, or a line whose indentation is known
        return start


class OutputFilter:
    """Feeds text through limits; `feed` returns the text to send and whether generation should stop."""

    def __init__(self, limits: list, t_max_predict_ms: int = 0):
        self.limits = limits
        self.t_max = t_max_predict_ms / 1000.0
        self.text = ""
        self.sent = 0
        self.first_at: float | None = None
        self.stopped = False  # a limit ended the text (llama.cpp's stop type "limit")

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if self.first_at is None:
            self.first_at = time.perf_counter()
        self.text += delta
        cuts = [c for c in (limit.cut(self.text) for limit in self.limits) if c is not None]
        if cuts:
            self.stopped = True
            return self._take(min(cuts)), True
        safe = min((limit.safe(self.text) for limit in self.limits), default=len(self.text))
        out = self._take(safe)
        # llama.cpp's t_max_predict_ms: past the time limit, stop once the text has a complete line
        if self.t_max and time.perf_counter() - self.first_at > self.t_max and "\n" in self.text:
            self.stopped = True
            return out + self.finish(), True
        return out, False

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
