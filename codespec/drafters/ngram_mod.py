"""`ngram-mod`: one fixed-size hash pool of "last n tokens -> next token", shared by every session.

As in llama.cpp's ngram-mod, the key is an LCG rolling hash of the last n tokens modulo the table
size, the value the token that followed (last write wins), and a draft rolls the hash forward until
it hits an empty slot. Memory is the two tables and nothing else, whatever the traffic.

What llama.cpp lacks is forgetting: when a session's history is rewritten, the pool keeps serving
continuations that no longer exist. Here each slot also counts its live contributions, and each
session logs the (slot, token) pairs it wrote, by history position. `truncate(new_len)` undoes the
session's own writes past new_len: a slot whose count drops to zero is emptied; a slot another
session wrote since (a different token) is left alone, and so are slots other sessions also hold.

Ageing: the pool resets (every slot emptied, every session's log voided by an epoch counter) when
occupancy passes `reset_occupancy`, or after `reset_low_rounds` drafts in a row whose acceptance was
below `reset_acceptance` — stale statistics cost verification time, and an empty pool costs nothing.

Hashing, learning, forgetting and drafting run in numba (one call each, no per-token Python): at a 3 ms forward,
the per-token loops of a step's learning cost as much as a marginal draft token gains.

A session learns what its history added when it is next asked to draft (and in begin()): the pool then holds, at
every draft, all that eager learning after each step would have put there, and while adaptive speculation holds
the drafter back (its drafts do not pay for its calls: adaptive.pays_to_call) it learns nothing until it is asked
again, then all it missed in one call. Learning was most of its cost a step (34 us of 44 on prose, timed inside
generations, right after forwards whose traffic left the host's caches cold), so holding it back saves it. Other sessions see a session's tokens
after its next draft: one step later, or the steps between two probes while it is held back.
"""

from __future__ import annotations

import numba
import numpy as np

from .base import Draft, Drafter

MULTIPLIER = 6364136223846793005  # llama.cpp's LCG multiplier
EMPTY = -1


@numba.njit(cache=True)
def _learn(values, counts, tokens, first, n, top_power):
    """Write "window -> next token" for every position p >= first of `tokens` (first >= n): a slot holding the
    token counts one more, another is overwritten with count 1. One call per step: hashing and writing together.
    Returns the slots and tokens written (one per position, for the undo log) and how many empty slots were filled."""
    size = np.uint64(len(values))
    slots = np.empty(len(tokens) - first, dtype=np.int64)
    written = np.empty(len(tokens) - first, dtype=np.int32)
    filled = 0
    h = np.uint64(0)
    for i in range(first - n, first):
        h = h * np.uint64(MULTIPLIER) + np.uint64(tokens[i])
    for p in range(first, len(tokens)):
        if p > first:  # roll the window on by one: drop tokens[p - n - 1], take tokens[p - 1]
            h = (h - np.uint64(tokens[p - n - 1]) * top_power) * np.uint64(MULTIPLIER) + np.uint64(tokens[p - 1])
        slot = np.int64(h % size)
        slots[p - first] = slot
        value = written[p - first] = tokens[p]
        current = values[slot]
        if current == value:
            counts[slot] += 1
        else:
            filled += current == EMPTY
            values[slot], counts[slot] = value, 1
    return slots, written, filled


@numba.njit(cache=True)
def _forget(values, counts, slots, old_values):
    """Undo writes where the slot still holds the written token; returns how many slots were emptied."""
    emptied = 0
    for i in range(len(slots)):
        slot, value = slots[i], old_values[i]
        if values[slot] == value and counts[slot] > 0:
            counts[slot] -= 1
            if counts[slot] == 0:
                values[slot] = EMPTY
                emptied += 1
    return emptied


@numba.njit(cache=True)
def _draft(values, tail, n, top_power, max_tokens):
    """Follow the pool from the last n tokens of `tail` until an empty slot or max_tokens: int32 [drafted]."""
    window = np.empty(n + max_tokens, dtype=np.int64)
    window[:n] = tail[len(tail) - n:]
    h = np.uint64(0)
    for i in range(n):
        h = h * np.uint64(MULTIPLIER) + np.uint64(window[i])
    size = np.uint64(len(values))
    drafted = 0
    while drafted < max_tokens:
        value = values[h % size]
        if value == EMPTY:
            break
        window[n + drafted] = value
        h = (h - np.uint64(window[drafted]) * top_power) * np.uint64(MULTIPLIER) + np.uint64(value)
        drafted += 1
    return window[n:n + drafted].astype(np.int32)


class NgramPool:
    def __init__(self, size: int = 4 << 20, n: int = 24, reset_occupancy: float = 0.25,
                 reset_low_rounds: int = 3, reset_acceptance: float = 0.5):
        self.size, self.n = size, n
        self.values = np.full(size, EMPTY, dtype=np.int32)  # next token per slot
        self.counts = np.zeros(size, dtype=np.int32)  # live contributions of that token
        self.occupied = 0
        self.epoch = 0  # bumped by reset(): undo logs from an earlier epoch are void
        self.resets = 0
        self.reset_occupancy, self.reset_low_rounds, self.reset_acceptance = (
            reset_occupancy, reset_low_rounds, reset_acceptance)
        self.low_rounds = 0
        # drop the top power once per roll: h(window shifted by one) = (h - first * A^(n-1)) * A + next
        self.top_power = np.uint64(pow(MULTIPLIER, n - 1, 1 << 64))

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.counts.nbytes

    @property
    def occupancy(self) -> float:
        return self.occupied / self.size

    def insert(self, tokens: np.ndarray, start: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Learn "window -> next token" for every position p >= max(start, n) of `tokens`. Returns the
        first position learned and the (slots, values) written, one per position, for an undo log."""
        first = max(start, self.n)
        if first >= len(tokens):
            return first, np.empty(0, np.int64), np.empty(0, np.int32)
        slots, values, filled = _learn(self.values, self.counts, tokens, first, self.n, self.top_power)
        self.occupied += filled
        if self.occupancy > self.reset_occupancy:
            self.reset()
        return first, slots, values

    def forget(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Undo writes: only where the slot still holds the token that was written."""
        if len(slots):
            self.occupied -= _forget(self.values, self.counts, slots, values)

    def draft(self, tail: np.ndarray, max_tokens: int) -> list[int]:
        """Follow the pool from the last n tokens until an empty slot or max_tokens."""
        if len(tail) < self.n or max_tokens <= 0:
            return []
        return _draft(self.values, np.asarray(tail[-self.n:], dtype=np.int64), self.n, self.top_power,
                      max_tokens).tolist()

    def record_round(self, drafted: int, accepted: int) -> None:
        """Ageing by acceptance: several poor drafts in a row mean the pool has gone stale."""
        if drafted == 0:
            return
        self.low_rounds = self.low_rounds + 1 if accepted / drafted < self.reset_acceptance else 0
        if self.low_rounds >= self.reset_low_rounds:
            self.reset()

    def reset(self) -> None:
        self.values.fill(EMPTY)
        self.counts.fill(0)
        self.occupied = 0
        self.low_rounds = 0
        self.epoch += 1
        self.resets += 1


class NgramMod(Drafter):
    """One session's view of the shared pool: feeds it what the session sees, drafts from it, and
    takes back its own contributions when the session's history is cut."""

    name = "ngram-mod"

    def __init__(self, pool: NgramPool):
        self.pool = pool
        self.epoch = pool.epoch
        self.learned = 0  # history positions already fed to the pool
        self.log_slots: list[np.ndarray] = []  # undo log, in history order, one array per insert
        self.log_values: list[np.ndarray] = []
        self.log_starts: list[int] = []  # history position of each array's first entry

    def begin(self, history, params) -> None:
        self._learn(history)

    def draft(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        if self.learned < len(history):  # the steps since its last draft (one, or all it was held back for)
            self._learn(history)
        tokens = self.pool.draft(history, max_tokens)
        return Draft(tokens) if tokens else None

    def accept(self, history: np.ndarray, drafted: int, accepted: int) -> None:
        self.pool.record_round(drafted, accepted)

    def truncate(self, new_len: int) -> None:
        self._sync_epoch()
        while self.log_starts and self.log_starts[-1] + len(self.log_slots[-1]) > new_len:
            start, slots, values = self.log_starts.pop(), self.log_slots.pop(), self.log_values.pop()
            keep = max(new_len - start, 0)
            self.pool.forget(slots[keep:], values[keep:])
            if keep:
                self.log_starts.append(start)
                self.log_slots.append(slots[:keep])
                self.log_values.append(values[:keep])
                break
        self.learned = min(self.learned, new_len)

    def _learn(self, history: np.ndarray) -> None:
        self._sync_epoch()
        epoch = self.pool.epoch
        first, slots, values = self.pool.insert(history, self.learned)
        if self.pool.epoch == epoch and len(slots):  # a reset during the insert voided what was written
            self.log_starts.append(first)
            self.log_slots.append(slots)
            self.log_values.append(values)
        self.learned = len(history)

    def _sync_epoch(self) -> None:
        if self.epoch != self.pool.epoch:  # the pool was reset: nothing of ours is left in it
            self.epoch = self.pool.epoch
            self.log_starts.clear(), self.log_slots.clear(), self.log_values.clear()
