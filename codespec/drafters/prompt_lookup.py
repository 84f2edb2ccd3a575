"""`prompt-lookup`: copy what followed the most recent earlier occurrence of the trailing n-gram.

Prompt Lookup Decoding (Saxena, 2023). Edits and completions repeat their context, so the tokens that
followed the same n-gram earlier are a good guess. Longest n first within [ngram_min, ngram_max]; the
most recent occurrence wins because nearby text predicts best. Stateless: it reads the history, so a
truncation needs no bookkeeping.

One pass in numba walks the history backwards from the most recent position, measuring how much of the
trailing n-gram ends there, and stops at the first (most recent) full-length match: a few microseconds for
thousands of tokens, where numpy's vectorised passes cost ~80 us a step (2-3% of a 3 ms forward, every step).
"""

from __future__ import annotations

import numba
import numpy as np

from .base import Draft, Drafter


@numba.njit(cache=True)
def _lookup(history, ngram_min, ngram_max):
    """The position after the most recent earlier occurrence of the longest trailing n-gram (ngram_min <= n <=
    ngram_max) of history; -1 when there is none."""
    length = len(history)
    best, best_n = -1, ngram_min - 1
    for end in range(length - 2, -1, -1):  # an occurrence ending at `end`, most recent first
        n = 0
        while n < ngram_max and n <= end and history[end - n] == history[length - 1 - n]:
            n += 1
        if n > best_n:
            best, best_n = end + 1, n
            if n == ngram_max:
                break
    return best


class PromptLookup(Drafter):
    name = "prompt-lookup"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def draft(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        if len(history) < self.ngram_min + 1:
            return None
        start = _lookup(np.asarray(history, dtype=np.int64), self.ngram_min, self.ngram_max)
        return Draft(history[start : start + max_tokens].tolist()) if start >= 0 else None
