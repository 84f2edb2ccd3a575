"""`prompt-lookup`: copy what followed the most recent earlier occurrence of the trailing n-gram.

Prompt Lookup Decoding (Saxena, 2023). Edits and completions repeat their context, so the tokens that
followed the same n-gram earlier are a good guess. Longest n first within [ngram_min, ngram_max]; the
most recent occurrence wins because nearby text predicts best. Stateless: it reads the history, so a
truncation needs no bookkeeping.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .base import Draft, Drafter


class PromptLookup(Drafter):
    name = "prompt-lookup"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def draft(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        length = len(history)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            # windows start at 0 .. length-1-n, so the trailing n-gram itself is never a match
            windows = sliding_window_view(history[: length - 1], n)  # [length-n, n]
            hits = np.flatnonzero((windows == history[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return Draft(history[start : start + max_tokens].tolist())
        return None
