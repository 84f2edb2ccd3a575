"""`ngram-map-k` / `ngram-map-k4v`: a per-session map "last n tokens -> the continuations seen after them".

As in llama.cpp's ngram-map, each key (the n tokens before a history position) keeps up to
MAX_CONTINUATIONS continuations with a hit count, and a key drafts only once its best continuation
has been seen `min_hits` times: a continuation that repeated is likelier to repeat again than the one
prompt lookup copies from a single earlier occurrence. `ngram-map-k4v` is stricter still: it drafts
only when the best continuation dominates, with at least 3x the hits of every other one combined
(counting occurrences beyond the tracked four), so a key that branches does not draft.

Continuations are told apart by their first token, the point where they branch, and are read lazily
from the history at draft time: up to m tokens after the most recent occurrence that has that many
tokens after it (else after the earliest, which has the most). Indexing a token is O(1), and a
continuation keeps growing as the text does.

Draft length cap: each continuation remembers how its last draft went. After a draft of d tokens
with a accepted, the next draft from it is capped at a + 2 tokens when a < d (what agreed last time,
plus a little to probe further), and the cap goes back to m when all d were accepted.

Forgetting: the drafter keeps its own copy of the tokens it indexed, so `truncate(new_len)` can
recompute and remove the occurrence at every position >= new_len (a continuation left without
occurrences disappears), and it undoes cap changes learned from drafts verified past new_len.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import SamplingParams
from .base import Draft, Drafter

MAX_CONTINUATIONS = 4  # llama.cpp's COMMON_NGRAM_MAX_VALUES
CAP_PROBE = 2  # after a partial acceptance of a tokens, the next draft from that continuation is a + 2 long
DOMINANCE = 3  # k4v: the best continuation needs this many times the hits of all others combined


@dataclass
class Continuation:
    positions: list[int] = field(default_factory=list)  # history positions of its first token, ascending
    cap: int | None = None  # longest next draft; None = m


@dataclass
class KeyEntry:
    occurrences: int = 0  # every occurrence of the key, also those past the tracked continuations
    continuations: dict[int, Continuation] = field(default_factory=dict)  # by first token


class NgramMap(Drafter):
    name = "ngram-map-k"
    dominance: int | None = None  # k4v sets DOMINANCE

    def __init__(self, n: int = 4, m: int = 16, min_hits: int = 2):
        if n < 1 or m < 1 or min_hits < 1:
            raise ValueError(f"ngram-map needs n, m, min_hits >= 1, got {n}, {m}, {min_hits}")
        self.n, self.m, self.min_hits = n, m, min_hits
        self.keys: dict[tuple[int, ...], KeyEntry] = {}
        self.tokens: list[int] = []  # the indexed history, so truncate can find what to forget
        # cap changes, in history order: (history length when learned, continuation, cap before)
        self.cap_log: list[tuple[int, Continuation, int | None]] = []
        self.drafted_from: Continuation | None = None

    def begin(self, history: np.ndarray, params: SamplingParams) -> None:
        self.sync(history)

    def draft(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        self.drafted_from = None
        self.sync(history)
        length = len(history)
        if length < self.n or max_tokens < 1:
            return None
        entry = self.keys.get(tuple(self.tokens[length - self.n :]))
        if entry is None or not entry.continuations:
            return None
        # most hits first; a tie goes to the continuation seen most recently
        best = max(entry.continuations.values(), key=lambda c: (len(c.positions), c.positions[-1]))
        hits = len(best.positions)
        if hits < self.min_hits:
            return None
        if self.dominance is not None and hits < self.dominance * (entry.occurrences - hits):
            return None
        want = min(max_tokens, self.m, best.cap or self.m)
        # the most recent occurrence with `want` tokens after it; near the end of a cycle the latest
        # one is too close to the end, and an earlier one has the whole continuation
        start = best.positions[0]
        for position in reversed(best.positions):
            if position + want <= length:
                start = position
                break
        self.drafted_from = best
        return Draft(history[start : start + want].tolist())

    def accept(self, history: np.ndarray, drafted: int, accepted: int) -> None:
        if self.drafted_from is not None and drafted > 0:
            continuation = self.drafted_from
            self.cap_log.append((len(history), continuation, continuation.cap))
            continuation.cap = None if accepted >= drafted else accepted + CAP_PROBE
        self.drafted_from = None
        self.sync(history)

    def truncate(self, new_len: int) -> None:
        self.drafted_from = None
        while self.cap_log and self.cap_log[-1][0] > new_len:
            _, continuation, previous = self.cap_log.pop()
            continuation.cap = previous
        for position in range(len(self.tokens) - 1, max(new_len, self.n) - 1, -1):
            self.forget(position)
        del self.tokens[new_len:]

    def sync(self, history: np.ndarray) -> None:
        """Index the positions the history gained since the last call (or forget, if it shrank)."""
        indexed = len(self.tokens)
        if len(history) < indexed:
            self.truncate(len(history))
        elif len(history) > indexed:
            self.tokens.extend(history[indexed:].tolist())
            for position in range(max(indexed, self.n), len(self.tokens)):
                self.learn(position)

    def learn(self, position: int) -> None:
        """The key ending before `position` was followed by the token at `position`."""
        key = tuple(self.tokens[position - self.n : position])
        entry = self.keys.get(key)
        if entry is None:
            entry = self.keys[key] = KeyEntry()
        entry.occurrences += 1
        first = self.tokens[position]
        continuation = entry.continuations.get(first)
        if continuation is None:
            if len(entry.continuations) >= MAX_CONTINUATIONS:
                return  # only counted in occurrences, as llama.cpp ignores values past its four slots
            continuation = entry.continuations[first] = Continuation()
        continuation.positions.append(position)

    def forget(self, position: int) -> None:
        """Undo learn(position); positions are forgotten from the last one down."""
        key = tuple(self.tokens[position - self.n : position])
        entry = self.keys[key]
        entry.occurrences -= 1
        first = self.tokens[position]
        continuation = entry.continuations.get(first)
        if continuation is not None and continuation.positions and continuation.positions[-1] == position:
            continuation.positions.pop()
            if not continuation.positions:
                del entry.continuations[first]
        if entry.occurrences == 0:
            del self.keys[key]


class NgramMapK4V(NgramMap):
    name = "ngram-map-k4v"
    dominance = DOMINANCE
