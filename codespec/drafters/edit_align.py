"""`edit-align`: for rewrites of a known text, draft the original tokens that follow where the output is.

A refactoring command hands the engine the selection it rewrites (the *reference*). Most of a rewrite
copies the reference in order, with a few insertions, deletions and substitutions, so a pointer into the
reference that moves along with the output predicts long runs of it:

- while the output follows the reference, the pointer advances token by token and a draft is simply the
  reference from the pointer on (as long as the caller allows);
- at the first output token that differs, the pointer is dropped; the next draft re-synchronises by
  finding the output's last few tokens in the reference (longest n first, the occurrence nearest after
  the last aligned point first, since a rewrite keeps the order), so the pointer lands behind an
  insertion, a deletion or a substitution as soon as the output is back on the original text.

Until the output has followed the reference for CONFIRMED tokens since the place was re-found, a draft is tentative:
the chain asks the drafters after it first (a model that wandered off the original into a loop of its own is drafted
better by ngram-mod than by a reference it keeps touching for a few tokens). From the start of a generation the
pointer is trusted: a rewrite usually starts where the original does.

Without a reference (an ordinary generation) it drafts nothing, so it is safe at the head of any chain.
Like every drafter it only changes speed: the target verifies every drafted token.
"""

from __future__ import annotations

import numpy as np

from .base import Draft, Drafter


CONFIRMED = 32  # output tokens that follow the reference after a re-sync before its drafts stop being tentative
# (measured, a 135M model's edit that fell into a loop: 3.6 tokens per forward with none, 4.9 with 8, 6.0 with 32,
# 6.2 without the reference)


class EditAlign(Drafter):
    name = "edit-align"
    follows_reference = True

    def __init__(self, ngram_min: int = 2, ngram_max: int = 6, near: int = 8):
        # resync keys: ngram_min..ngram_max output tokens; a single token only re-anchors within `near`
        # reference tokens after the last aligned point (one token alone matches too much elsewhere)
        self.ngram_min, self.ngram_max, self.near = ngram_min, ngram_max, near
        self.source = np.empty(0, dtype=np.int64)  # the reference tokens of this generation
        self.pairs: set = set()  # its adjacent token pairs: an output whose last two are none of them has no n-gram
        # of 2 or more in the reference, so a resync skips the passes over it (a prediction that does not match
        # resyncs at every step: 0.1-0.4 ms each, ~1% of a request)
        self.start = 0  # history position where this generation's output begins
        self.seen = 0  # history positions already walked by accept()
        self.pointer: int | None = None  # reference index of the next expected output token; None: lost
        self.anchor = 0  # reference index just after the last aligned token
        self.followed = 0  # output tokens that followed the reference since the pointer was last (re)set
        self.trusted = False  # the pointer has not been lost since the generation began

    def set_reference(self, tokens) -> None:
        """The text being rewritten, for the next generation (None: no reference, draft nothing)."""
        self.source = np.asarray(tokens if tokens is not None else [], dtype=np.int64)
        self.pairs = set(zip(self.source[:-1].tolist(), self.source[1:].tolist()))

    def begin(self, history, params) -> None:
        self.start = self.seen = len(history)
        self.pointer = 0 if len(self.source) else None  # a rewrite usually starts where the original does
        self.anchor = self.followed = 0
        self.trusted = True

    def draft(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        if not len(self.source) or len(history) < self.start:
            return None
        if self.pointer is None:
            self._find(history)
        if self.pointer is None or self.pointer >= len(self.source):
            return None
        return Draft(self.source[self.pointer : self.pointer + max_tokens].tolist(),
                     tentative=not self.trusted and self.followed < CONFIRMED)

    def accept(self, history: np.ndarray, drafted: int, accepted: int) -> None:
        # walk every new token, whoever drafted it: the pointer follows the output, not the drafts
        for token in history[self.seen :].tolist():
            if self.pointer is not None and self.pointer < len(self.source) and self.source[self.pointer] == token:
                self.pointer += 1
                self.anchor = self.pointer
                self.followed += 1
            else:
                self.pointer, self.trusted = None, False
        self.seen = len(history)
        if self.pointer is None and len(self.source):  # re-found here, not only when asked to draft: a drafter held
            self._find(history)  # back, or asked after another's draft, still follows the output and earns trust

    def _find(self, history: np.ndarray) -> None:
        self.pointer, self.followed, self.trusted = self._resync(history[self.start :]), 0, False

    def truncate(self, new_len: int) -> None:
        self.seen = min(self.seen, new_len)
        self.pointer, self.trusted = None, False  # re-find the place from what is left of the output
        if new_len < self.start:  # the whole output (and maybe the prompt) is gone
            self.start = new_len

    def _resync(self, output: np.ndarray) -> int | None:
        """The reference index after an occurrence of the output's trailing n-gram, or None."""
        if not len(output):
            return 0  # nothing written yet (or all of it was cut): the rewrite starts where the original does
        longest = min(self.ngram_max, len(output))
        if longest >= 2 and (int(output[-2]), int(output[-1])) not in self.pairs:
            longest = 1  # (no longer n-gram can end here either)
        for n in range(longest, 0, -1):
            if 1 < n < self.ngram_min:
                continue
            ends = self._ends(output[-n:])
            if n < self.ngram_min:  # a single token: only just after the last aligned point
                ends = ends[(ends >= self.anchor) & (ends < self.anchor + self.near)]
            if ends.size:
                after = ends[ends >= self.anchor]  # the nearest one that keeps the order, else the last one
                self.anchor = int(after[0] if after.size else ends[-1]) + 1
                return self.anchor
        return None

    def _ends(self, tail: np.ndarray) -> np.ndarray:
        """Reference positions where an occurrence of `tail` ends (one vectorised pass, then filters)."""
        n, source = len(tail), self.source
        ends = np.flatnonzero(source[n - 1 :] == tail[-1]) + n - 1
        for back in range(1, n):
            ends = ends[source[ends - back] == tail[-1 - back]]
        return ends
