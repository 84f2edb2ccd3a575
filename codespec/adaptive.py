"""Adaptive speculation: how many draft tokens to verify, and whether to speculate at all.

A verify forward over n tokens costs `cost(n)` seconds, measured once per device, model and precision
(`measure_costs`, cached on disk). Each drafter's draft tokens are accepted with probability `alpha`,
estimated from the drafts the target checked, with old evidence fading. Verifying k draft tokens then
yields 1 + alpha + ... + alpha^k tokens on average for cost(pending + k); `choose` takes the k (0 = plain
decoding) with the most tokens per second. A held-back draft still teaches: the target's own next token
is compared with the first draft token it did not verify, so a drafter that was switched off is switched
back on as soon as it would pay again. With exact costs and alpha, speculation is never slower.

The forward is not the whole step. At a 3 ms forward, the host's own work per step (the sampler, the session's
bookkeeping, the drafters' learning) and each drafter's drafting are as large as what a marginal draft saves, so
both are measured as generation runs (`DraftingCosts`, shared by the engine's sessions): the host work is part of
every step's price in `allocate`, and a drafter whose calls save less than they cost (mostly empty drafts, or
drafts too poor to verify) is held back, then probed at growing intervals, as a draft model is.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from .config import MODEL_DRAFTERS, codespec_home
from .errors import CodespecError

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # tokens per forward that are timed; others are interpolated


class CostModel:
    """Seconds of one forward over n tokens: measured at SIZES over a cache of `context` tokens, interpolated in
    between, then corrected by the forwards that generation actually runs (so a measurement disturbed by other load
    heals). Attention grows with the cache each row reads: a sequence costs `key_seconds` per cached key (reading its
    keys and values) plus `row_key_seconds` per row per cached key (the products), both measured on a longer cache.
    On this CPU, at 1,400 cached tokens, one more row of a verify costs ~1.8 ms where the table at 256 says 0.8:
    drafts priced by the table alone were verified where they made a tick of 8 sessions slower. A forward over
    several sequences also pays a little for each (`per_sequence`, learnt from those forwards apart from the table:
    folded into it, a tick of 8 sessions' single rows made one draft token look as dear as a whole session)."""

    LEARN = 0.1  # weight of each observed forward in its size's running estimate
    width: int | None = None  # the most rows one session may have in a forward (None: any; BucketCosts: its width)

    def __init__(self, sizes: tuple[int, ...], seconds: tuple[float, ...], pinned: bool = False,
                 key_seconds: float = 0.0, row_key_seconds: float = 0.0, context: int = 256):
        self.sizes, self.seconds, self.pinned = tuple(sizes), tuple(seconds), pinned
        # never cheaper for more tokens: a noisy small size takes the cheapest larger size's time
        monotone = np.minimum.accumulate(np.asarray(seconds, dtype=np.float64)[::-1])[::-1]
        # (Python lists: cost() runs dozens of times a step, and numpy's scalars are slow to index and add)
        self.measured = np.interp(np.arange(sizes[-1] + 1), sizes, monotone).tolist()  # [n] -> seconds, n = 0..last
        self.one = self.measured[1]  # a one-token forward's learnt seconds
        self.ratio = 1.0  # the sizes past one row: their learnt time over their measured one scaled by the load
        self.ones = 0  # one-token forwards observed
        self.seen = 0  # self.ones when a size past one row was last observed
        self.key_seconds, self.row_key_seconds, self.context = key_seconds, row_key_seconds, context
        self.per_sequence = 0.0  # seconds each sequence past the first adds to a forward, learnt

    def cost(self, tokens: int, sequences: int = 1, keys: int | None = None, row_keys: int | None = None) -> float:
        """Seconds for a forward over `tokens` tokens of `sequences` sequences; extended linearly past the last size.
        keys: the cached tokens of all the sequences together, row_keys: the sum over sequences of rows x cached
        tokens (None: each sequence over a cache of the table's length)."""
        return max(self._rows(tokens) + self._attention(tokens, sequences, keys, row_keys),
                   0.25 * self._rows(tokens)) + self.per_sequence * max(sequences - 1, 0)

    def _rows(self, tokens: int) -> float:
        last = len(self.measured) - 1
        if tokens <= last:
            return self._learnt(max(tokens, 1))
        slope = (self._learnt(last) - self._learnt(self.sizes[-2])) / (last - self.sizes[-2])
        return self._learnt(last) + slope * (tokens - last)

    RELAX = 0.05  # the sizes' learnt excess over their measured time (scaled by the load) fades by this share with
    # each one-token forward since one of them last ran

    def _learnt(self, tokens: int) -> float:
        """A size's running estimate: its measured time scaled by the load (how one-token forwards compare with
        theirs now), times what forwards over more rows taught beyond that: one factor for every size past one row,
        so the measured table's shape decides between them and the forwards its level. Learnt per size, the sizes
        that ran looked dearer than those that had not (their excess was the cache's attention and the load, which
        every size pays): a prediction followed to the end verified 7-16 tokens a step at alpha 0.997, 12.2 tokens
        a forward where the measured table alone gave 16.5, and decoded at 624 tok/s against 710 (default model,
        three edits, 9 interleaved requests each way, 2026-11-28); with one factor, 16.0 and 739 against 751 (the
        same runs again). An excess fades with each one-token forward
        since a larger size last ran: a burst of load that priced drafts high is forgotten even where that price
        kept them from running (a bench run beside a test suite priced 2 rows at 19.5 ms against 4.7 for one)."""
        if tokens == 1:
            return self.one
        ratio = self.ratio
        if ratio > 1.0:
            ratio = 1.0 + (ratio - 1.0) * (1.0 - self.RELAX) ** (self.ones - self.seen)
        return self.measured[tokens] * self._load() * ratio

    def _load(self) -> float:
        return self.one / self.measured[1] if self.measured[1] > 0 else 1.0

    def _attention(self, tokens: int, sequences: int, keys: int | None, row_keys: int | None) -> float:
        """What the caches add beyond the table's (one sequence over `context` keys)."""
        if keys is None:
            return 0.0
        return self.key_seconds * (keys - self.context) + self.row_key_seconds * (row_keys - self.context * tokens)

    def observe(self, tokens: int, seconds: float, sequences: int = 1, keys: int | None = None,
                row_keys: int | None = None) -> None:
        """A forward over one sequence moves its size's estimate (at the table's cache length); over several, what
        each sequence past the first added beyond the table's time for the tokens and the caches."""
        if not 1 <= tokens < len(self.measured) or self.pinned:
            return
        seconds -= self._attention(tokens, sequences, keys, row_keys)
        if sequences <= 1:  # (a forward past OUTLIER times its estimate moves it as if it had taken that many)
            estimate = self._learnt(tokens)
            estimate += self.LEARN * (min(seconds, DraftingCosts.OUTLIER * estimate) - estimate)
            if tokens == 1:
                self.one = estimate
                self.ones += 1
            elif self.measured[tokens] > 0:
                self.ratio = estimate / (self.measured[tokens] * self._load())
                self.seen = self.ones
        else:
            each = max(seconds - self._rows(tokens), 0.0) / (sequences - 1)
            self.per_sequence += self.LEARN * (each - self.per_sequence)

    def relative(self, tokens: int) -> float:
        return self.cost(tokens) / self.cost(1)

    def to_dict(self) -> dict:
        return {"tokens": list(self.sizes), "ms": [round(s * 1e3, 2) for s in self.seconds], "context": self.context,
                "ms_per_1000_keys": [round(self.key_seconds * 1e6, 4), round(self.row_key_seconds * 1e6, 4)]}


def measure_costs(path, vocab_size: int, context: int = 256, sizes: tuple[int, ...] = SIZES,
                  repeats: int = 6, longer: int = 1024, budget: float | None = None) -> CostModel:
    """Time forwards over each size on top of `context` cached tokens, then the smallest size and the size nearest
    16 on top of `context + longer` (what a cached key costs, once per sequence and per row). The sizes take turns,
    one forward each a round, for `repeats` rounds after a warm-up round, and the fastest of a size's rounds counts:
    other load on the machine only ever adds time, and a burst of it then costs one size one round, not every
    repeat of one size (timed back to back, a 40 ms burst priced 2 rows at 2.5x one on a 2-core AVX2 host, where
    they take 1.2x, and held back every one-token draft of a whole bench run). A round goes from the largest size
    down, and a size whose forward is short runs SETTLE times untimed before its timed one: generation runs
    forwards of a few sizes back to back, and a forward right after a much longer one costs more than it does there
    (on a 2-core Intel Xeon, 2026-12-07: a one-token forward right after a 128-row one 7.0-7.5 ms, the next three
    7.2, 6.1 and 4.9, then 4.2-4.5; timed that way, the table's one row was priced so high that every size past it
    looked cheap: a draft row at 0.3-0.4 of what it added to a run of one-token forwards; timed settled, from the
    largest down, 0.96-1.14 of it).
    budget: seconds the timed forwards may take, at least LEAST rounds after the warm-up: the warm-up round goes
    from the smallest size up and stops where a size would not fit, and fewer rounds run where `repeats` would not.
    A size not timed is priced as dear a token as the largest one timed (more rows never cost a token more: steady),
    so a draft that long is verified only where it pays at that price. Unbounded, the table took 75 s for a 1.7B
    Q4_K_M model on a 2-core AVX2 host, before its first token (128 rows alone took 3 s a forward).
    The caches' keys are copies of a few computed ones (StaticCache.stretch: prefilling 1,280 tokens took that
    model 30 s); a cache that cannot stretch is prefilled."""
    rng = np.random.default_rng(0)
    room = getattr(path, "context", None)  # a path with caches of fixed size (graphs.py): what fits
    if room is not None:
        context = min(context, room // 4)
        sizes = tuple(n for n in sizes if context + n <= room) or sizes[:1]
        longer = min(longer, room - context - 2 * max(sizes))
    cache = path.new_cache()
    grow(path, cache, context, rng, vocab_size)
    tokens = {size: rng.integers(0, vocab_size, size).tolist() for size in sizes}

    def once(size: int) -> float:
        length, started = cache.length, time.perf_counter()
        path(cache, tokens[size], size)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # (graphs.py's batch waits for the device itself)
        seconds = time.perf_counter() - started
        cache.crop(length)
        return seconds

    short: set[int] = set()  # sizes whose forward is short: each timed one follows SETTLE untimed ones

    def settled(size: int) -> float:
        for _ in range(SETTLE if size in short else 0):
            once(size)
        return once(size)

    def fastest(chosen: tuple[int, ...], warm_up: bool = True) -> list[float]:
        # each round from the largest size down, each row of timings in `chosen`'s order
        timings = [[settled(size) for size in reversed(chosen)][::-1] for _ in range(repeats + warm_up)][warm_up:]
        return [min(column) for column in zip(*timings)]

    warm: list[float] = []  # round 0 warms up, and with a budget picks the sizes and the rounds that fit it
    for size in sizes:
        if budget is not None and warm:  # this size guessed as dear a token as the last one timed
            if (sum(warm) + warm[-1] * size / sizes[len(warm) - 1]) * (LEAST + 1) > budget:
                break
        warm.append(once(size))
    timed = sizes[: len(warm)]
    short.update(size for size, seconds in zip(timed, warm) if seconds < SETTLE_BELOW)
    if budget is not None:
        a_round = sum(seconds * (1 + SETTLE * (size in short)) for size, seconds in zip(timed, warm))
        repeats = max(LEAST, min(repeats, int(budget / a_round) - 1))
    table = fastest(timed, warm_up=False)
    table += [table[-1] * n / timed[-1] for n in sizes[len(timed) :]]
    key_seconds = row_key_seconds = 0.0
    few, many = timed[0], max(n for n in timed if n <= 16)
    if longer > 0 and many > few:
        grow(path, cache, context + longer, rng, vocab_size)
        added = {n: max(seconds - table[sizes.index(n)], 0.0) / longer
                 for n, seconds in zip((few, many), fastest((few, many)))}  # per key, n rows
        row_key_seconds = max(added[many] - added[few], 0.0) / (many - few)
        key_seconds = max(added[few] - few * row_key_seconds, 0.0)
    return CostModel(tuple(sizes), tuple(table), key_seconds=key_seconds, row_key_seconds=row_key_seconds,
                     context=context)


LEAST = 2  # timed rounds after the warm-up, however little a budget leaves
SETTLE = 4  # untimed forwards of a size before each timed one, for sizes whose forward takes under SETTLE_BELOW
SETTLE_BELOW = 0.025  # seconds
BUDGET = 5.0  # seconds of timed forwards for a table kept on disk (cached_costs): the default model's whole table, 6
# rounds (~4 s on a 2-core AVX2 host); a 1.7B model's sizes up to 16 or 32, 2 rounds; a 7B's up to 2 or 4


def grow(path, cache, length: int, rng, vocab_size: int) -> None:
    """`cache` holding `length` positions: where it can stretch, 16 computed by a forward over random tokens and
    copies of them; else all computed."""
    stretches = hasattr(cache, "stretch")
    computed = min(length, 16) if stretches else length
    if cache.length < computed:
        path(cache, rng.integers(0, vocab_size, computed - cache.length).tolist(), 1)
    if cache.length < length:
        cache.stretch(length)


class BucketCosts(CostModel):
    """Seconds of a tick of the graph-safe forward (forward/graphs.py): its bucket's forward, once per width of rows
    the busiest session needs, and once per largest bucket of sessions. Every session's rows are `width` rows of one
    forward over a bucket of sessions (1, 2, 4, 8, 16), whatever each one verifies, so a draft up to the width is
    free: the adaptive budget works per bucket. Each session verifies at most width - pending draft tokens
    (decode.verify_lengths), and allocate() then verifies every draft token offered, since a row that costs nothing
    never lowers the tokens per second (a draft model's own time per drafted token still counts against its
    tokens). Measured at start for every bucket (a few forwards each, on the pool's scratch slot: no session's
    memory), then corrected by the forwards generation runs, as CostModel is."""

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


def pinned_costs(file: str) -> CostModel:
    """$CODESPEC_COSTS: a cost table in the shape `to_dict` writes ({"tokens": [...], "ms": [...]}, optionally
    "context" and "ms_per_1000_keys": [per sequence, per row]), used as it is, never measured nor learnt, so that
    adaptive choices repeat on a noisy machine."""
    try:
        data = json.loads(Path(file).read_text())
        per_key, per_row_key = (float(ms) / 1e6 for ms in data.get("ms_per_1000_keys", (0.0, 0.0)))
        return CostModel(tuple(int(n) for n in data["tokens"]), tuple(float(ms) / 1e3 for ms in data["ms"]),
                         pinned=True, key_seconds=per_key, row_key_seconds=per_row_key,
                         context=int(data.get("context", 256)))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CodespecError(f"CODESPEC_COSTS={file}: not a cost table like {{\"tokens\": [1, 2], \"ms\": [10, 11]}}"
                         f" ({error})") from None


@functools.cache
def forward_code() -> str:
    """A digest of the modules a forward runs, and of this one, which measures them: a table measured before they
    changed (an upgrade, a faster kernel, another way of timing) is measured again. (A table of 2026-11-25 measured
    before the q8 kernels took prompts, and on a busy host, priced 8 rows at 24.6 ms where they took 8.7, and kept 8
    sessions from verifying any draft.)"""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for module in sorted((Path(__file__).parent / "forward").rglob("*.py")):
        digest.update(module.read_bytes())
    return digest.hexdigest()[:16]


STEADY = 1.25  # from one measured size to the next, a forward may cost this much less and a token this much more


def steady(sizes: tuple[int, ...], seconds: tuple[float, ...]) -> bool:
    """Whether a measured table looks undisturbed: from each size to the next a forward costs no less than the
    smaller one's (more rows never cost less) and a token no more (more rows share the weights' reads), within
    STEADY. Load from elsewhere during a measurement breaks this: tables kept on disk by earlier runs beside other
    work priced one row at 487 ms and eight at 32 (a quiet measurement: 4.7 and 8.3), or 32 rows at 12 ms a token
    where 16 took 2.1, and every later run on the machine inherited them."""
    pairs = zip(zip(sizes, seconds), zip(sizes[1:], seconds[1:]))
    return all(more * STEADY >= less and more / n_more <= STEADY * less / n_less
               for (n_less, less), (n_more, more) in pairs)


def measure_steady(path, vocab_size: int, attempts: int = 3) -> tuple[CostModel, bool]:
    """measure_costs until the table is steady (at most `attempts` times), and whether it is."""
    for _ in range(attempts):
        costs = measure_costs(path, vocab_size, budget=BUDGET)
        if steady(costs.sizes, costs.seconds):
            return costs, True
    return costs, False


def cached_costs(path, model, vocab_size: int) -> CostModel:
    """measure_costs, remembered on disk for a named model on this machine, device, precision and thread count; a
    table measured unsteady (another process's load) serves this run but is not kept, and one on disk that is not
    steady is measured again."""
    if getattr(path, "buckets", None):  # the graph-safe forward: a tick costs its bucket's forward (a few ms)
        return measure_bucket_costs(path, vocab_size)
    name = getattr(model.config, "_name_or_path", "") or ""
    if not name:
        return measure_steady(path, vocab_size)[0]
    key = json.dumps([name, str(model.device), str(model.dtype), type(path).__name__, getattr(path, "reads", ""),
                      getattr(path, "invariant", False),
                      str(getattr(path, "cache_dtype", "")),
                      torch.get_num_threads(),
                      torch.__version__, platform.processor(), platform.node(), os.environ.get("CODESPEC_CPU", ""),
                      list(SIZES), forward_code()])
    file = codespec_home() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    try:
        data = json.loads(file.read_text())
        sizes, seconds, keys = list(data["sizes"]), list(data["seconds"]), list(data["keys"])
        # a file cut short by a kill, written by another version or edited by hand is measured again
        if sizes == list(SIZES) and len(seconds) == len(SIZES) and all(
                type(s) in (int, float) and 0 < s < float("inf") for s in seconds) and len(keys) == 2 and all(
                type(s) in (int, float) and 0 <= s < 1 for s in keys) and steady(SIZES, seconds):
            return CostModel(SIZES, tuple(float(s) for s in seconds), key_seconds=keys[0], row_key_seconds=keys[1])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs, kept = measure_steady(path, vocab_size)
    if not kept:
        return costs
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps({"key": key, "sizes": costs.sizes, "seconds": costs.seconds,
                                    "keys": [costs.key_seconds, costs.row_key_seconds]}))
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return costs


@dataclass
class Acceptance:
    """Evidence that one drafter's tokens are accepted: a Beta(1/2, 1/2) prior plus fading counts. A
    drafter that is always wrong ends at alpha = 0.5 / (1 + 1 / (1 - FADE)) = 0.045, too low to pay on
    any device we measured; a right one climbs within a few drafts."""

    FADE = 0.9  # weight kept by earlier evidence at each new draft: about the last ten drafts count
    PRIOR = 0.5

    hits: float = 0.0
    misses: float = 0.0
    skipped: int = 0  # drafts not verified because they would not have paid
    vouched: float = 0.0  # hits the caller vouched for (Adaptive.expect), counted from the drafter's first hit to its
    # first miss

    def observe(self, hits: int, missed: bool) -> None:
        self.hits = self.FADE * self.hits + hits
        self.misses = self.FADE * self.misses + missed
        if missed:
            self.vouched = 0.0

    @property
    def alpha(self) -> float:
        hits = self.hits + (self.vouched if self.hits else 0.0)
        return (hits + self.PRIOR) / (hits + self.misses + 2 * self.PRIOR)


def choose(costs: CostModel, alpha: float, available: int, pending: int, draft_cost: float = 0.0,
           keys: int | None = None, host: float = 0.0) -> int:
    """The number of draft tokens (0..available) that maximises expected tokens per second; draft_cost is
    the seconds drafting one more token costs (a draft model's forward; n-gram drafts are free); keys: the tokens
    the session's cache holds (None: as many as the cost table's); host: the step's seconds outside the forward."""
    return allocate(costs, [(alpha, available, keys)], pending, 1, draft_cost=draft_cost, host=host)[0]


def allocate(costs: CostModel, proposals: list[tuple[float, int, int | None]], rows: int, generating: int,
             sequences: int = 1, keys: int | None = None, row_keys: int | None = None,
             draft_cost: float = 0.0, host: float = 0.0) -> list[int]:
    """choose() for a batch. A forward over `rows` tokens of `sequences` sequences (whose caches hold `keys` tokens,
    `row_keys` = rows x cached tokens summed over them) gives `generating` sessions one token each; each proposal
    is a drafter's acceptance rate alpha, the draft tokens it offers and the tokens its session's cache holds (a
    proposal's session is among the sequences, its pending rows among the rows; None everywhere: caches as long as
    the cost table's). Verifying the j-th token of a draft adds one row and alpha^j expected tokens, so the best
    rows to add are those with the most expected tokens per second of the row's own cost (each draft's in order, as
    alpha^j falls with j): take them in that order and stop where the batch yields the most tokens per second.
    `host`: the seconds the step costs outside the forward whatever it verifies (every session's host work), which
    a token more per step spreads thinner. Returns the tokens each proposal verifies. Speculating never makes the
    batch slower than the same batch without drafts, and one proposal with rows = its pending tokens is exactly
    choose()."""
    known = keys is not None or all(p[2] is not None for p in proposals)
    cached = [costs.context if p[2] is None else p[2] for p in proposals]  # each proposal's cache
    if known:
        keys = keys if keys is not None else sum(cached)
        row_keys = row_keys if row_keys is not None else rows * keys

    def seconds(extra: int, extra_keys: int) -> float:
        if not known:
            return costs.cost(rows + extra, sequences) + host
        return costs.cost(rows + extra, sequences, keys, row_keys + extra_keys) + host

    plain = seconds(0, 0)
    slope = max(seconds(1, 0) - plain, 1e-9)

    def value(gain: tuple[float, int]) -> float:  # expected tokens per second of the row's own cost
        return gain[0] / (slope + (costs.row_key_seconds * cached[gain[1]] if known else 0.0) + draft_cost)

    gains = sorted(((alpha ** j, index) for index, (alpha, available, _) in enumerate(proposals)
                    for j in range(1, available + 1)), key=lambda gain: -value(gain))  # stable: a draft keeps its order
    best, best_rate = 0, generating / plain
    expected, extra_keys = float(generating), 0
    for extra, (gain, index) in enumerate(gains, 1):
        expected += gain
        extra_keys += cached[index]
        # more rows never cost less, whatever noise the learnt estimates picked up
        rate = expected / (max(seconds(extra, extra_keys), plain) + extra * draft_cost)
        if rate > best_rate:
            best, best_rate = extra, rate
    counts = [0] * len(proposals)
    for _, index in gains[:best]:
        counts[index] += 1
    return counts


@dataclass
class DraftingCosts:
    """What a step costs beyond the forward on this machine, and how model drafters have done lately, shared by
    every session of an engine: a new session starts from it rather than paying again to learn it."""

    LEARN = 0.1  # weight of each new measurement in the host and call times (about the last ten count)

    seconds: dict[str, float] = field(default_factory=dict)  # a model drafter's seconds per drafted token
    catch_up: dict[str, float] = field(default_factory=dict)  # one sync of a held-back drafter's cache
    acceptance: dict[str, Acceptance] = field(default_factory=dict)  # a model drafter's evidence over all sessions
    calls: dict[str, float] = field(default_factory=dict)  # an n-gram drafter's seconds per call (its draft())
    host: float = 0.0  # a step's seconds outside the forward and the drafters' draft() calls
    pinned: bool = False  # with a pinned cost table ($CODESPEC_COSTS) the step's other costs are not learnt either:
    # adaptive choices must repeat whatever the machine's load (the tests pin one)

    OUTLIER = 4.0  # a call or host time past this many times its estimate (a page fault, a collection, another
    # process's burst) moves the estimate as if it had taken this many times: one pause must not hold a drafter back

    def observe_call(self, drafter: str, seconds: float) -> None:
        if self.pinned:
            return
        previous = self.calls.get(drafter)
        if previous is None or seconds * self.OUTLIER < previous:  # (a call this much faster than the estimate: the
            # estimate came from a disturbed call, e.g. a drafter's very first, 3 ms where the next took 8 us)
            self.calls[drafter] = seconds
            return
        self.calls[drafter] = previous + self.LEARN * (min(seconds, self.OUTLIER * previous) - previous)

    def observe_host(self, seconds: float) -> None:
        if self.pinned:
            return
        self.host = seconds if self.host == 0.0 else self.host + self.LEARN * (
            min(seconds, self.OUTLIER * self.host) - self.host)


@dataclass
class Adaptive:
    """One session's acceptance evidence per drafter, and the device's costs."""

    PROBE = 16  # a model drafter judged not to pay still drafts one token after PROBE skipped steps, to notice a
    PROBE_MAX = 256  # change; each probe that misses doubles the wait, up to PROBE_MAX, so probing costs next to nothing
    PROBE_SHARE = 0.01  # and never more than this share of the time: a probe first syncs the drafter's cache
    LEARN = 0.2  # weight of each new draft in a drafter's per-token drafting time

    costs: CostModel
    shared: DraftingCosts = field(default_factory=DraftingCosts)
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    probe_wait: dict[str, int] = field(default_factory=dict)  # skipped steps before a model drafter's next probe
    probe_countdown: dict[str, int] = field(default_factory=dict)
    held_back: set[str] = field(default_factory=set)  # model drafters whose cache fell behind the history
    savings: dict[str, float] = field(default_factory=dict)  # an n-gram drafter's seconds saved per call, fading
    calls: dict[str, int] = field(default_factory=dict)  # an n-gram drafter's calls in this session

    def draft_limit(self, pending: int, keys: int | None = None):
        """limit(name, available) for Chain.draft: how many tokens a model drafter should draft at all, its
        own time per token counted. N-gram drafters cost next to nothing and always draft in full. A model drafter
        that was held back drafts again only through a probe: its next draft first has to read every token it
        missed, a cost that choose() does not see, and probes are spaced to keep that cost small."""
        def limit(drafter: str, available: int) -> int:
            if drafter not in MODEL_DRAFTERS:
                return available if self.pays_to_call(drafter) else 0
            seconds = self.shared.seconds.get(drafter)
            if seconds is None:  # not timed yet: drafting two tokens measures what one more costs
                return min(available, 2)
            evidence = self.of(drafter)
            tokens = 0 if drafter in self.held_back else choose(self.costs, evidence.alpha, available, pending, seconds,
                                                                         keys, self.shared.host)
            if tokens == 0:
                evidence.skipped += 1
                countdown = self.probe_countdown.get(drafter)
                if countdown is None:
                    countdown = self.probe_interval(drafter, pending, self.PROBE)
                countdown -= 1
                if countdown <= 0:  # probe once, then wait twice as long for the next one
                    wait = self.probe_wait[drafter] = min(2 * self.probe_wait.get(drafter, self.PROBE), self.PROBE_MAX)
                    countdown, tokens = self.probe_interval(drafter, pending, wait), 1
                self.probe_countdown[drafter] = countdown
            if tokens == 0:
                self.held_back.add(drafter)
            else:  # a probe or a draft: the drafter's cache is in step with the history again
                self.held_back.discard(drafter)
            return tokens
        return limit

    CALL_EVIDENCE = 4  # a session judges an n-gram drafter's calls after this many (its first drafts teach alpha)
    CALL_PROBE = 4  # an n-gram drafter held back is called again after this many steps (or more, where its call
    # would cost over PROBE_SHARE of the steps in between, up to CALL_PROBE_MAX), to notice when its drafts turn right
    CALL_PROBE_MAX = 64
    HOLD_SHARE = 0.005  # held back only where its calls cost this share of a step more than they save: a numba
    # drafter's 5-20 us a call is not worth the risk of missing its good drafts for a few steps

    def pays_to_call(self, drafter: str) -> bool:
        """Whether an n-gram drafter's calls have lately saved more than they cost (draft() time against the
        step time its accepted tokens saved); one that does not is skipped but for a probe every CALL_PROBE steps."""
        cost, saving = self.shared.calls.get(drafter), self.savings.get(drafter)
        step = self.costs.cost(1) + self.shared.host
        if (drafter == "none" or cost is None or saving is None or self.calls.get(drafter, 0) < self.CALL_EVIDENCE
                or cost - saving < self.HOLD_SHARE * step):  # (skipping it would gain next to nothing)
            self.probe_countdown.pop(drafter, None)
            return True
        wait = min(max(self.CALL_PROBE, math.ceil(cost / (self.PROBE_SHARE * step))), self.CALL_PROBE_MAX)
        countdown = self.probe_countdown.get(drafter, wait)
        self.probe_countdown[drafter] = countdown - 1
        if countdown > 1:
            return False
        del self.probe_countdown[drafter]
        return True

    def observe_calls(self, called: list[tuple[str, float]], winner: str | None, saved: float) -> None:
        """One step's drafter calls (name, seconds of its draft()) in chain order; `winner` drafted and its draft
        saved `saved` seconds (the accepted tokens' share of a step less the verified rows' own cost), the others
        saved nothing. Model drafters are timed by observe_draft instead."""
        for drafter, seconds in called:
            if drafter in MODEL_DRAFTERS:
                continue
            self.shared.observe_call(drafter, seconds)
            self.calls[drafter] = self.calls.get(drafter, 0) + 1
            value = saved if drafter == winner else 0.0
            previous = self.savings.get(drafter)
            self.savings[drafter] = value if previous is None else previous + DraftingCosts.LEARN * (value - previous)

    def probe_interval(self, drafter: str, pending: int, wait: int) -> int:
        """Steps until the next probe: `wait`, or more when a probe (a sync of the drafter's cache, then one
        token) would cost more than PROBE_SHARE of the plain steps in between."""
        probe = self.shared.catch_up.get(drafter, 0.0) + self.shared.seconds.get(drafter, 0.0)
        return max(wait, math.ceil(probe / (self.PROBE_SHARE * (self.costs.cost(max(pending, 1)) + self.shared.host))))

    def observe_draft(self, drafter: str, tokens: int, seconds: float, catch_up_seconds: float = 0.0) -> None:
        """A drafter took `seconds` to draft `tokens` tokens after `catch_up_seconds` syncing its cache with the
        history; only model drafters' times are kept. A draft model's first token comes from the forward that syncs
        its cache, and each further one from a forward of its own: after a catch-up, only the further ones tell
        what a token costs."""
        if drafter not in MODEL_DRAFTERS:
            return
        if catch_up_seconds > 0:
            self._learn(self.shared.catch_up, drafter, catch_up_seconds)
            if tokens > 1:
                self._learn(self.shared.seconds, drafter, seconds / (tokens - 1))
        else:
            self._learn(self.shared.seconds, drafter, seconds / tokens)

    def _learn(self, table: dict[str, float], drafter: str, value: float) -> None:
        previous = table.get(drafter)
        table[drafter] = value if previous is None else previous + self.LEARN * (value - previous)

    EXPECTED_HITS = 30.0  # the evidence a reference the caller vouches for starts with: alpha 0.984, as after two
    # full drafts accepted (at 0.95, the default model verified 9 of 16 tokens at first, and 13 next)

    def expect(self, drafter: str) -> None:
        """This generation's caller expects its output to follow what `drafter` drafts from (OpenAI's Predicted
        Outputs, a rewrite command's selection: edit-align's reference): the drafter's evidence starts anew as if
        EXPECTED_HITS of its tokens had been accepted once its first draft is right, so its drafts are verified in
        full from the second step. From the default prior alone (alpha 0.5) a rewrite that followed its prediction
        took four steps to reach full drafts (2, 6, 9 and 13 tokens: 2 forwards more in a 265-token rewrite, 11% of
        them). Counted from the start, a wrong reference cost a 16-row verify at once; held past a miss, several.
        So the vouched hits count from the drafter's first hit to its first miss; then its own evidence decides."""
        self.acceptance[drafter] = Acceptance(vouched=self.EXPECTED_HITS)

    def of(self, drafter: str) -> Acceptance:
        """This session's evidence for a drafter; a model drafter's starts from the engine's."""
        evidence = self.acceptance.get(drafter)
        if evidence is None:
            evidence = replace(self.shared.acceptance.get(drafter, Acceptance()), skipped=0)
            self.acceptance[drafter] = evidence
        return evidence

    def observe(self, drafter: str, draft: list[int], verified: int, accepted: int, next_token: int) -> None:
        """The target accepted `accepted` of the first `verified` draft tokens, then chose next_token."""
        evidence = self.of(drafter)
        if verified < len(draft) and accepted == verified:  # the target's own token checks one more
            hits, missed = accepted + (next_token == draft[verified]), next_token != draft[verified]
        else:
            hits, missed = accepted, accepted < verified
        evidence.observe(hits, missed)
        if drafter in MODEL_DRAFTERS:
            self.shared.acceptance.setdefault(drafter, Acceptance()).observe(hits, missed)
        if verified == 0:
            evidence.skipped += 1
        if hits > 0:  # a model drafter that was right is probed at the short interval again
            self.probe_wait.pop(drafter, None)
