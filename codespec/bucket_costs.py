"""What a tick costs on the graph-safe forward (forward/graphs.py), where every session's rows are `width` rows of
one forward over a bucket of sessions (1, 2, 4, 8, 16), whatever each one verifies. So a tick costs its bucket's
forward, and a draft up to the width is free: the adaptive budget works per bucket. Each session verifies at most
width - pending draft tokens (decode.verify_lengths), and allocate() then verifies every draft token offered, since
a row that costs nothing never lowers the tokens per second (a draft model's own time per drafted token still
counts against its tokens). Measured at start for every bucket (a few forwards each, on the pool's scratch slot:
no session's memory), then corrected by the forwards generation runs, as CostModel is."""

from __future__ import annotations

import time

import numpy as np
import torch

from .adaptive import CostModel, DraftingCosts


class BucketCosts(CostModel):
    """Seconds of a tick of the graph-safe forward: its bucket's forward, once per width of rows the busiest
    session needs, and once per largest bucket of sessions."""

    def __init__(self, buckets: tuple[int, ...], seconds: tuple[float, ...], width: int, pinned: bool = False):
        super().__init__(tuple(buckets), tuple(seconds), pinned=pinned)
        self.width = width  # each session's rows in a forward: pending tokens and draft tokens together
        self.learnt = list(seconds)  # each bucket's running estimate

    def _bucket(self, sequences: int) -> int:
        """The index of the bucket that runs this many sequences (at most the largest a forward)."""
        return next(i for i, size in enumerate(self.sizes) if size >= min(sequences, self.sizes[-1]))

    def cost(self, tokens: int, sequences: int = 1, keys: int | None = None, row_keys: int | None = None) -> float:
        sequences = max(sequences, 1)
        launches = -(-sequences // self.sizes[-1])
        passes = max(1, -(-tokens // (self.width * sequences)))  # rows past a width each run another forward
        return self.learnt[self._bucket(sequences)] * launches * passes

    def observe(self, tokens: int, seconds: float, sequences: int = 1, keys: int | None = None,
                row_keys: int | None = None) -> None:
        if self.pinned or not 1 <= tokens <= self.width * sequences or sequences > self.sizes[-1]:
            return  # (a tick of several passes or launches teaches nothing about one forward)
        index = self._bucket(sequences)
        estimate = self.learnt[index]
        self.learnt[index] += self.LEARN * (min(seconds, DraftingCosts.OUTLIER * estimate) - estimate)
        if sequences == 1:
            self.one = self.learnt[index]


def measure_bucket_costs(path, vocab_size: int, repeats: int = 6) -> BucketCosts:
    """The fastest of `repeats` forwards of each bucket (taking turns, after a warm-up round) at a quarter of the
    context, on the pool's scratch slot."""
    rng = np.random.default_rng(0)
    start = path.context // 4

    def once(size: int) -> float:
        ids = rng.integers(0, vocab_size, size * path.width).tolist()
        started = time.perf_counter()
        path.scratch_forward(ids, size, start)
        return time.perf_counter() - started

    timings = [[once(size) for size in path.buckets] for _ in range(repeats + 1)][1:]
    return BucketCosts(path.buckets, tuple(min(column) for column in zip(*timings)), path.width)
