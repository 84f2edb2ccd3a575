"""`prompt-lookup`: copy what followed the most recent earlier occurrence of the trailing n-gram.

Prompt Lookup Decoding (Saxena, 2023). Edits and completions repeat their context, so the tokens that
followed the same n-gram earlier are a good guess. Longest n first within [ngram_min, ngram_max]; the
most recent occurrence wins because nearby text predicts best. Stateless: it reads the history, so a
truncation needs no bookkeeping.

One vectorised pass finds every earlier position holding the last token; each longer n only filters
those few candidates by the token before, so a draft costs one comparison over the history.
"""

from __future__ import annotations

import numpy as np

from .base import Draft, Drafter


class PromptLookup(Drafter):
    name = "prompt-lookup"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def draft(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        length = len(history)
        if length < self.ngram_min + 1:
            return None
        # ends: positions before the last one that hold the last token, i.e. where a match would end
        ends = np.flatnonzero(history[: length - 1] == history[length - 1])
        matches_by_n = [ends]  # matches_by_n[n - 1]: ends of earlier occurrences of the trailing n-gram
        for n in range(2, min(self.ngram_max, length - 1) + 1):
            previous = matches_by_n[-1]
            previous = previous[previous >= n - 1]
            matches_by_n.append(previous[history[previous - (n - 1)] == history[length - n]])
        for n in range(len(matches_by_n), self.ngram_min - 1, -1):
            matches = matches_by_n[n - 1]
            if matches.size:
                start = int(matches[-1]) + 1
                return Draft(history[start : start + max_tokens].tolist())
        return None
