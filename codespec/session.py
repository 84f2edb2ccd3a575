"""A session: one token history and the KV cache that covers it.

Invariant between steps: the cache holds keys/values for history[:cached]; the tokens after that
(`pending`, at least one) are fed with the next forward. Editors resend nearly the same prompt on every
keystroke, so a new prompt keeps the longest common prefix and prefills only the rest.
"""

from __future__ import annotations

import numpy as np

from .drafters import Chain
from .drafters.base import common_prefix


class Session:
    def __init__(self, path, chain: Chain, session_id: str | None = None):
        """path: the target forward (forward.py), shared by all sessions; each session has its own cache."""
        self.id = session_id
        self.path = path
        self.chain = chain
        self.spec = None  # the SpecConfig the chain was built from
        self.cache = path.new_cache()
        self.adaptive = None  # acceptance evidence per drafter, set by the engine (adaptive.py)
        self._tokens = np.zeros(1024, dtype=np.int64)
        self.length = 0

    @property
    def history(self) -> np.ndarray:
        view = self._tokens[: self.length]
        view.flags.writeable = False
        return view

    @property
    def cached(self) -> int:
        return self.cache.length

    @property
    def nbytes(self) -> int:
        """The memory this session holds: its KV cache and its history."""
        return self.cache.nbytes + self._tokens.nbytes

    @property
    def pending(self) -> list[int]:
        return self._tokens[self.cached : self.length].tolist()

    def prepare(self, prompt: list[int]) -> int:
        """Make the history equal to `prompt`, reusing the common prefix; return the prompt tokens reused."""
        common = common_prefix(self.history, prompt)
        if common < self.length:
            self.truncate(common)  # the history was rewritten: tell the drafters
        self.append(prompt[common:])
        # at least the last prompt token must be fed, to get the logits for the first new token
        self.crop_cache(min(self.cached, len(prompt) - 1))
        return self.cached

    def append(self, tokens: list[int]) -> None:
        needed = self.length + len(tokens)
        if needed > len(self._tokens):
            grown = np.zeros(max(needed, 2 * len(self._tokens)), dtype=np.int64)
            grown[: self.length] = self._tokens[: self.length]
            self._tokens = grown
        self._tokens[self.length : needed] = tokens
        self.length = needed

    def truncate(self, new_len: int) -> None:
        """Cut the history back to new_len tokens; the cache follows and every drafter is told."""
        if new_len >= self.length:
            return
        self.length = new_len
        self.crop_cache(min(self.cached, new_len))  # prepare() leaves the last token pending again
        self.chain.truncate(new_len)

    def crop_cache(self, new_len: int) -> None:
        self.cache.crop(new_len)

    def use_chain(self, chain: Chain) -> None:
        """Swap the drafters (a request asked for another spec). The old ones are told the history is
        gone, so shared structures forget what this session taught them; the new ones start from here."""
        self.chain.truncate(0)
        self.chain = chain

    def reset(self) -> None:
        self.truncate(0)
        self.cache = self.path.new_cache()
