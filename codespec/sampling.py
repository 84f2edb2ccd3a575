"""Turn target logits into accepted tokens: greedy, or lossless speculative sampling."""

from __future__ import annotations

import numba
import numpy as np
import torch

from .config import SamplingParams


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as transformers applies them. logits: [n, vocab] -> probs."""
    kept = _kept(logits, params)
    if kept is None:
        return (logits.float() / params.temperature).softmax(-1)
    values, order = kept
    return torch.zeros(logits.shape, device=logits.device).scatter_(-1, order, values.softmax(-1))


def _kept(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tokens top-k and top-p may keep of each row of logits [n, vocab]: their logits over the temperature (-inf
    where top-p drops one) and their ids [n, count], most likely first; None where both keep every token.

    Only the most likely tokens are sorted: the top k (taken before the division: only they are divided), or for
    top-p alone as many as cover top_p in every row (64, then 4x more until they do; sorting a 49,152-token row took
    1.6 ms on a CPU)."""
    vocab = logits.shape[-1]
    top_k = 0 < params.top_k < vocab
    if not top_k and params.top_p >= 1.0:
        return None
    if top_k:
        values, order = top(logits, params.top_k)  # [n, count], most likely first
        values = values.float() / params.temperature
        weights = (values - values[:, :1]).double().exp()  # (as WarpedRows.draw weighs them)
        ranked = weights / weights.sum(-1, keepdim=True)
    else:  # top-p alone reads the whole distribution
        logits = logits.float() / params.temperature
        weights = (logits - logits.max(-1, keepdim=True).values).exp()  # (as WarpedRows.draw weighs them: softmax's
        # own exp differs in the last bits, which moved the top-p edge where the distribution is flat)
        full, count = weights / weights.double().sum(-1, keepdim=True), min(64, vocab)
        while True:
            values, order = torch.topk(logits, count, dim=-1)
            ranked = full.gather(-1, order)
            if count == vocab or bool((ranked.sum(-1) >= params.top_p).all()):
                break
            count = min(count * 4, vocab)
    if params.top_p < 1.0:
        # drop a token when the tokens ranked above it already cover top_p (every token past `count` is dropped),
        # summed in float64 as WarpedRows.draw's numba sums them (float32's sum of thousands of small probabilities
        # was off by ~1e-4: the kept tokens then differed by dozens where the distribution is flat)
        ranked = ranked.double()
        values = values.masked_fill(ranked.cumsum(-1) - ranked >= params.top_p, float("-inf"))
    return values, order


def top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(logits, k, dim=-1) of logits [n, vocab]: the k largest of each row and their ids, largest first
    (of equal ones the lower id first). A CPU's float32 rows go through `_top`: torch.topk took 160-200 us a row of
    49,152 on a 2-core CPU, a sampled token's whole share of a tick where three alternatives sample together."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not 0 < k <= logits.shape[-1]:
        return torch.topk(logits, k, dim=-1)  # (and its error for a k it cannot take)
    rows = logits.detach().contiguous().numpy()
    if len(rows) == 1:  # (a sampled row: mostly one a call)
        values, ids = _top(rows[0], k)
        return torch.from_numpy(values)[None], torch.from_numpy(ids)[None]
    values, ids = zip(*(_top(row, k) for row in rows))
    return torch.from_numpy(np.stack(values)), torch.from_numpy(np.stack(ids))


BLOCK = 64  # logits a block of `_top` skips whole where its largest cannot be among the k largest


@numba.njit(cache=True, boundscheck=False)
def _top(row, k):
    """The k largest of row (float32) and their ids, largest first, of equal ones the lower id first: 40 us a row of
    49,152. A block of BLOCK whose largest is under the k-th largest of the blocks' largest holds none of them
    (each of those k is a logit at least as large), so only the other blocks are read one by one, in order, into a
    sorted list of k."""
    blocks = row.shape[0] // BLOCK
    largest = np.empty(blocks, np.float32)
    _block_largest(row, largest)
    floor = _largest(largest, 0, blocks, k)[0][k - 1] if blocks >= k else -np.inf
    values, ids, held = np.empty(k, np.float32), np.empty(k, np.int64), 0
    for b in range(blocks + 1):  # (the last: what is left past whole blocks)
        if b == blocks or largest[b] >= floor:
            held = _insert(row, b * BLOCK, min(row.shape[0], b * BLOCK + BLOCK), values, ids, held)
    return values, ids


@numba.njit(cache=True, boundscheck=False)
def _largest(row, first, last, k):
    """(values, ids): the k largest of row[first:last], as `_top` gives them."""
    values, ids = np.empty(k, np.float32), np.empty(k, np.int64)
    _insert(row, first, last, values, ids, 0)
    return values, ids


@numba.njit(cache=True, boundscheck=False)
def _insert(row, first, last, values, ids, held):
    """row[first:last] into the sorted list (values, ids) of the largest so far, `held` of its len(values) places
    filled: each one larger than its last goes in past the smaller ones only (an equal one keeps its place above,
    so the lower id stays first). Returns the places filled."""
    k = values.shape[0]
    for i in range(first, last):
        x = row[i]
        if held == k and not x > values[k - 1]:
            continue
        j = held if held < k else k - 1
        while j > 0 and values[j - 1] < x:
            if j < k:
                values[j], ids[j] = values[j - 1], ids[j - 1]
            j -= 1
        values[j], ids[j] = x, i
        held = min(held + 1, k)
    return held


@numba.njit(cache=True, boundscheck=False, fastmath={"nnan", "nsz"})
def _block_largest(row, largest):
    """largest[b] = the largest of row's block b of BLOCK (vectorised: logits hold no NaN)."""
    for b in range(largest.shape[0]):
        best = row[b * BLOCK]
        for i in range(b * BLOCK + 1, b * BLOCK + BLOCK):
            best = max(best, row[i])
        largest[b] = best


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [vocab] (not necessarily normalised): the cumulative sum inverted at one uniform draw.
    torch.multinomial took 1.3 ms a row over a 49,152-token vocabulary on a CPU, more than a forward; this takes
    ~0.1 ms. A token of probability 0 is never drawn (the first position whose sum exceeds the draw)."""
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_max(len(cdf) - 1))


class Sampler:
    """Decides how much of a draft the target accepts, and the target's own next token.

    Every method gets logits: [k+1, vocab] for the positions after the last pending token and after
    each of the k draft tokens, and returns (accepted draft tokens, next token).
    """

    def __init__(self, params: SamplingParams, device: str = "cpu"):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.generators = {"cpu": self.generator}  # one per device the logits come from, seeded from the first
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias's tokens and values, on the device

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The session's generator on the logits' device, so that sampling happens where the logits are (on a
        GPU: no copy of [k+1, vocab] probabilities to the host), and a seed repeats there."""
        key = str(device)
        if key not in self.generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.generator.initial_seed())
            self.generators[key] = generator
        return self.generators[key]

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0

    def bias(self, logits: torch.Tensor) -> None:
        """Add the request's logit_bias to every row of logits [n, vocab], in place (the rows are this session's:
        the model's distribution becomes the one it samples from, so the verify accepts what the biased model
        would have chosen, and speculation stays lossless with respect to it)."""
        if not self.params.logit_bias:
            return
        if self._bias is None or self._bias[0].device != logits.device:
            merged: dict[int, float] = {}  # (a token named twice gets both biases, as llama.cpp adds them)
            for token, value in self.params.logit_bias:
                merged[token] = merged.get(token, 0.0) + value
            tokens, values = zip(*merged.items())
            self._bias = (torch.tensor(tokens, device=logits.device),
                          torch.tensor(values, dtype=logits.dtype, device=logits.device))
        tokens, values = self._bias
        logits[:, tokens] += values

    def verify(self, logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None = None,
               targets: list[int] | None = None):
        """targets: the argmax of each row when the forward took it already (graphs.py: no wait for the device)."""
        if self.greedy:
            return verify_greedy(logits, draft, targets)
        generator = self.generator_for(logits.device)
        if draft_probs is None:
            return verify_sampled_exact(WarpedRows(logits, self.params), draft, generator)
        probs = warp(logits, self.params)
        return verify_rejection(probs, draft, draft_probs.float().to(probs.device), generator)


class WarpedRows:
    """warp() of each row of logits [k+1, vocab], computed when it is read: a sampled verify reads the rows up to its
    first mismatch, mostly one or two of them (warping all k+1 rows of a 49,152-token vocabulary cost more than
    the forward on a CPU)."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams):
        self.logits, self.params = logits, params

    def __getitem__(self, row: int) -> torch.Tensor:
        return warp(self.logits[row : row + 1], self.params)[0]

    def draw(self, row: int, generator: torch.Generator) -> int:
        """draw(self[row]) without the vocabulary-wide warped vector where it can: on a CPU's float32 row in numba
        (`_draw_top`, `_draw_weighted`), at the same one uniform draw; elsewhere the tokens top-k and top-p keep, in
        token order (their cumulative sum is the whole row's at every token kept)."""
        logits = self.logits[row]
        params = self.params
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            u = float(torch.rand(1, generator=generator, dtype=torch.float64))
            if 0 < params.top_k < logits.shape[-1]:
                return int(_draw_top(logits.detach().contiguous().numpy(), params.top_k, params.temperature,
                                     params.top_p, u))
            scaled = logits.detach() / params.temperature
            largest = scaled.max()
            if not torch.isfinite(largest):  # (every logit -inf: no distribution; the first, as an argmax)
                return int(scaled.argmax())
            weights = (scaled - largest).exp()  # (torch's exp: vectorised)
            return int(_draw_weighted(scaled.numpy(), weights.numpy(), params.top_p, u))
        kept = _kept(self.logits[row : row + 1], params)
        if kept is None:
            return draw(self[row], generator)
        values, order = kept
        ids, by_id = order[0].sort()
        return int(ids[draw(values.softmax(-1)[0][by_id], generator)])


@numba.njit(cache=True, boundscheck=False)
def _draw_top(row, k, temperature, top_p, u):
    """The token warp() of row [vocab] draws at the uniform u with top-k: the k largest logits (`_top`) over the
    temperature, of those the most likely that cover top_p (each kept while those ranked above it cover less, as
    `_kept`), their weights inverted at u in token order (`_invert`). A sampled row of 49,152 logits (top_k 40,
    top_p 0.99) on a 2-core Intel host: ~45 us, against 122 us with `top` and torch's small ops, 195-232 with
    torch.topk."""
    values, ids = _top(row, k)
    scaled = values / np.float32(temperature)
    if not np.isfinite(scaled[0]):  # (every logit -inf: no distribution; the first of the largest, as an argmax)
        return ids[0]
    weights = np.exp((scaled - scaled[0]).astype(np.float64))
    if top_p < 1.0:
        weights[_covering(weights, top_p * weights.sum()):] = 0.0
    order = np.argsort(ids)
    return ids[order][_invert(weights[order], u)]


@numba.njit(cache=True, boundscheck=False)
def _draw_weighted(scaled, weights, top_p, u):
    """The token warp() draws at the uniform u without top-k: scaled [vocab] the logits over the temperature,
    weights = exp(scaled - max) (float32); with top_p < 1 only the most likely that cover it, each kept while those
    ranked above it (a larger scaled logit, or an equal one and a lower id) cover less: among the RANKED largest
    (`_top`) where they cover it, else by buckets (`_nucleus`). torch.topk's 64, then 4x more until they covered
    top_p, took 2.4 ms a row where they were many (~0.8 ms here); on the default model's logits of code 566 ->
    296 us (top_p 0.9), and without top-p 205 -> 170 us."""
    vocab = weights.shape[0]
    if top_p >= 1.0:
        return _invert(weights, u)
    covered = top_p * _sum(weights, 0, vocab)
    ids = _top(scaled, min(RANKED, vocab))[1]
    count = _covering(weights[ids], covered)
    if count < len(ids) or len(ids) == vocab:
        kept = np.sort(ids[:count])
        return kept[_invert(weights[kept], u)]
    kept_mask = np.empty(vocab, np.bool_)
    _nucleus(scaled, weights, covered, kept_mask)
    return _invert(np.where(kept_mask, weights, np.float32(0.0)), u)


@numba.njit(cache=True, boundscheck=False)
def _covering(ranked, covered):
    """How many of the weights `ranked` (most likely first) top-p keeps: each while those before it cover less than
    `covered` (all of them where they never do)."""
    total = 0.0
    for i in range(ranked.shape[0]):
        if total >= covered:
            return i
        total += ranked[i]
    return ranked.shape[0]


RANKED = 64  # `_draw_weighted`'s most likely tokens, sorted, that mostly cover top-p (the default model on code)
INVERT_BLOCK = 64  # `_invert`'s weights a block: summed in 8 running sums, then block by block


@numba.njit(cache=True, boundscheck=False)
def _sum(weights, first, last):
    """weights[first:last] summed in float64: 8 running sums (lanes i mod 8), added in pairs; then the rest."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    whole = first + (last - first) // 8 * 8
    for i in range(first, whole, 8):
        a0 += weights[i]
        a1 += weights[i + 1]
        a2 += weights[i + 2]
        a3 += weights[i + 3]
        a4 += weights[i + 4]
        a5 += weights[i + 5]
        a6 += weights[i + 6]
        a7 += weights[i + 7]
    total = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    for i in range(whole, last):
        total += weights[i]
    return total


@numba.njit(cache=True, boundscheck=False)
def _invert(weights, u):
    """The index whose weight holds u x the weights' total in their running sum (float64, in order): the block of
    INVERT_BLOCK where the blocks' running sum passes it, then the first index of that block whose own running sum
    does (its last weighted one where rounding leaves it short). A weight of 0 is never the answer: one draw from
    the weights' distribution, as draw() makes it (a sequential sum of 49,152 float64s: ~65 us)."""
    blocks = (weights.shape[0] + INVERT_BLOCK - 1) // INVERT_BLOCK
    sums = np.empty(blocks, np.float64)
    for b in range(blocks):
        sums[b] = _sum(weights, b * INVERT_BLOCK, min(weights.shape[0], (b + 1) * INVERT_BLOCK))
    total = 0.0
    for b in range(blocks):
        total += sums[b]
    target, running, last = u * total, 0.0, -1
    for b in range(blocks):
        if sums[b] > 0.0:
            last = b
            if running + sums[b] > target:
                break
            running += sums[b]
    answer = 0
    for i in range(max(last, 0) * INVERT_BLOCK, min(weights.shape[0], (last + 1) * INVERT_BLOCK)):
        if weights[i] > 0.0:
            answer = i
            running += weights[i]
            if running > target:
                return i
    return answer


BUCKETS = 256  # `_nucleus`'s buckets: how far below the largest a scaled logit is, in steps of 1 / BUCKET_STEPS
BUCKET_STEPS = 16


@numba.njit(cache=True, boundscheck=False)
def _nucleus(scaled, weights, covered, kept):
    """kept[i] = whether token i is among the most likely whose weights cover `covered` (as `_draw_weighted` keeps
    them) without sorting the vocabulary: the weights summed by bucket of how far below the largest each is, and
    only the bucket where they reach `covered` sorted."""
    largest = scaled.max()
    bucket = np.empty(scaled.shape[0], np.int64)
    mass = np.zeros(BUCKETS, np.float64)
    for i in range(scaled.shape[0]):
        below = (largest - scaled[i]) * BUCKET_STEPS
        bucket[i] = int(below) if below < BUCKETS - 1 else BUCKETS - 1  # (the far tail and -inf: the last)
        mass[bucket[i]] += weights[i]
    total, edge = 0.0, BUCKETS - 1
    for b in range(BUCKETS):
        if total + mass[b] >= covered:
            edge = b
            break
        total += mass[b]
    members = np.empty(scaled.shape[0], np.int64)
    count = 0
    for i in range(scaled.shape[0]):
        kept[i] = bucket[i] < edge
        if bucket[i] == edge:
            members[count] = i
            count += 1
    members = members[:count]
    for j in np.argsort(-scaled[members], kind="mergesort"):  # (stable: of equal ones the lower id first)
        if total >= covered:
            break
        kept[members[j]] = True
        total += weights[members[j]]


def verify_greedy(logits: torch.Tensor, draft: list[int], targets: list[int] | None = None) -> tuple[int, int]:
    """Accept the longest prefix of the draft that matches the target's argmax, then its own next token."""
    if targets is None:  # [k+1]; numpy's on a CPU's float32 (torch's woke its thread pool: 124 us against 9)
        float32_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
        targets = (logits.numpy().argmax(-1) if float32_cpu else logits.argmax(-1)).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return accepted, targets[accepted]


def verify_sampled_exact(probs: torch.Tensor, draft: list[int], generator) -> tuple[int, int]:
    """Deterministic drafts: sample the target at every position and accept while it equals the draft.

    A deterministic draft token d has q(d) = 1, so rejection sampling accepts it with probability p(d)
    and otherwise resamples from p restricted to tokens != d: exactly "sample from p, compare".
    Rows are sampled in order and none past the first mismatch, so every emitted token is drawn from the target.
    probs: [k+1, vocab], or WarpedRows.
    """
    for accepted in range(len(draft) + 1):
        token = probs.draw(accepted, generator) if isinstance(probs, WarpedRows) else draw(probs[accepted], generator)
        if accepted == len(draft) or token != draft[accepted]:
            return accepted, token


def verify_rejection(probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor, generator):
    """Sampled drafts with distributions q (a draft model): accept d with probability min(1, p(d)/q(d));
    on rejection draw from normalise(max(p - q, 0)). Lossless for any q (Leviathan et al., 2023).

    probs: [k+1, vocab] target; draft_probs: [k, vocab] the distributions each draft token was drawn from.
    """
    k = len(draft)
    index = torch.arange(k, device=probs.device)
    draft_ids = torch.tensor(draft, dtype=torch.long, device=probs.device)
    p_draft = probs[index, draft_ids]  # [k]
    q_draft = draft_probs[index, draft_ids]  # [k]
    uniforms = torch.rand(k, generator=generator, device=probs.device)
    accept = uniforms * q_draft <= p_draft  # u < p/q without dividing by a zero q
    accepted = int(accept.int().cumprod(0).sum()) if k else 0
    if accepted < k:
        residual = (probs[accepted] - draft_probs[accepted]).clamp_min(0)
        total = residual.sum()
        residual = residual / total if total > 0 else probs[accepted]
        return accepted, draw(residual, generator)
    return accepted, draw(probs[k], generator)
