"""The speculative step: draft -> verify every draft token in one target forward -> accept.

Greedy output is token-for-token the output of plain greedy decoding; sampled output has the target's
distribution (see sampling.py). Drafters change how many tokens one forward yields, never which.

A step is a generator that asks its driver two things: how many of its draft tokens to verify (`Propose`,
answered with a count) and the forward itself (`forward.Rows`, answered with the logits). Alone, `drive` answers
at once; the scheduler collects the requests of every active session and answers them together: one choice of
draft lengths for the whole batch (adaptive.allocate) and one forward over all of their rows (`forward_batch`).
Batch size 1 is the same code.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

from .adaptive import Adaptive, CostModel, allocate
from .forward import Rows
from .healing import Constraint
from .sampling import Sampler
from .session import Session
from .stats import GenerationStats


@dataclass
class Step:
    tokens: list[int]  # tokens this step appended to the history
    drafted: int  # draft tokens that were verified
    accepted: int  # of those, tokens the target agreed with
    forward_seconds: float  # the target forward (shared with the other sessions of its batch)
    finished: str | None = None  # "eos" or "length" when generation must stop here
    logprobs: list | None = None  # with SamplingParams.logprobs >= 0: each token's TokenLogprob


@dataclass
class TokenLogprob:
    """A new token's log-probability under the model (the log-softmax of its logits, temperature 1), and the `top`
    most likely tokens at its position with theirs: read from the verify forward's row for that position, which on
    the batch-invariant path holds the bits a plain one-token forward gives it."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each of `tokens` (row i of logits [>= len(tokens), vocab] is the distribution it was chosen from)."""
    import torch

    rows = torch.log_softmax(logits[: len(tokens)].double(), dim=-1)
    best = torch.topk(rows, top, dim=-1) if top > 0 else None
    return [TokenLogprob(token, float(rows[i, token]),
                         list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else [])
            for i, token in enumerate(tokens)]


@dataclass
class Propose:
    """A step's question to its driver: how many of the `available` tokens its drafter proposed to verify,
    given the session's `pending` tokens that the forward feeds anyway. The answer is an int."""

    adaptive: Adaptive
    drafter: str
    available: int
    pending: int
    keys: int  # tokens the session's cache holds (each row it adds attends to them)

    @property
    def alpha(self) -> float:
        return self.adaptive.of(self.drafter).alpha


def verify_lengths(costs: CostModel, proposals: list[Propose], rows: list[Rows]) -> list[int]:
    """The answers to one batch's proposals: draft lengths chosen together, with the rows that are in the forward
    anyway (every pending token, prefill chunks)."""
    base = sum(len(r.ids) for r in rows) + sum(p.pending for p in proposals)
    generating = sum(r.generating for r in rows) + len(proposals)
    keys, row_keys = attended(rows)
    keys += sum(p.keys for p in proposals)
    row_keys += sum(p.pending * p.keys for p in proposals)
    width = costs.width  # graph-safe forwards: a session's rows are a width (adaptive.BucketCosts)
    available = [p.available if width is None else max(min(p.available, width - p.pending), 0) for p in proposals]
    return allocate(costs, [(p.alpha, offered, p.keys) for p, offered in zip(proposals, available)], base, generating,
                    sequences=len(rows) + len(proposals), keys=keys, row_keys=row_keys,
                    host=sum(p.adaptive.shared.host for p in proposals))


def attended(rows: list[Rows]) -> tuple[int, int]:
    """The cached tokens the rows' sequences attend to (what a forward's attention costs: adaptive.CostModel): their
    sum, and their sum weighted by each sequence's rows."""
    return sum(r.cache.length for r in rows), sum(len(r.ids) * r.cache.length for r in rows)


def forward_batch(path, rows: list[Rows], costs: CostModel | None = None) -> list:
    """One forward over every sequence's rows; each learns how long it took, and so do the measured costs: from
    forwards without a prompt chunk, which take a path of their own (bfloat16 weights, a forward apart: LeanLlama.batch)
    and price nothing that is verified. Taught by them, one prefill of a 930-token prompt (128-token chunks at 180-240
    ms, where the table's 128 verify rows took 119) raised every multi-row estimate by a third, and n_cmpl's
    alternatives, whose forwards are never one row (the excess fades only with one-token forwards), kept it for the
    whole request (2026-12-07)."""
    keys, row_keys = attended(rows)
    started = time.perf_counter()
    logits = path.batch(rows)
    seconds = time.perf_counter() - started
    for r in rows:
        r.seconds = seconds
    if costs is not None and not any(r.prompt for r in rows):
        costs.observe(sum(len(r.ids) for r in rows), seconds, sequences=len(rows), keys=keys, row_keys=row_keys)
    return logits


def drive(steps, path, costs: CostModel | None = None):
    """Run a step generator alone: answer its proposals and run its forwards at once. Yields what it yields
    otherwise; returns what it returns."""
    reply = None
    with closing(steps):  # a consumer that stops early ends the steps too, between two of them
        while True:
            try:
                item = steps.send(reply)
            except StopIteration as stop:
                return stop.value
            if isinstance(item, Propose):
                reply = verify_lengths(item.adaptive.costs, [item], [])[0]
            elif isinstance(item, Rows):
                reply = forward_batch(path, [item], costs)[0]
            else:
                reply = yield item


def next_output(steps):
    """Inside a step generator: pass another step generator's requests up to our driver, return its next
    output (None once it has ended)."""
    reply = None
    while True:
        try:
            item = steps.send(reply)
        except StopIteration:
            return None
        if not isinstance(item, (Propose, Rows)):
            return item
        try:
            reply = yield item
        except GeneratorExit:  # our driver gave up on us while `steps` waited for its answer
            steps.close()
            raise


def speculative_step(session: Session, sampler: Sampler, draft_max: int, budget: int,
                     context: int, eos_ids: frozenset[int], adaptive: Adaptive | None = None,
                     constraint: Constraint | None = None):
    """One step (a generator: see the module's doc), returning a Step: at most `budget` new tokens, never past
    `context` positions or past an EOS. With `adaptive`, only as much of the draft is verified as pays on this
    device (maybe none), and the step's own host time and drafter calls are measured for its pricing."""
    busy = 0.0  # seconds this step runs on the host, outside its driver's answers (the forward)
    started = time.perf_counter()
    history = session.history
    room = context - len(history)  # positions left for draft tokens plus the target's own token
    pending = session.pending
    limit = adaptive.draft_limit(len(pending), session.cache.length) if adaptive is not None else None
    drafting = time.perf_counter()
    fits = min(budget - 1, room - 1)  # a reference's drafts may reach past draft_max (Chain.reach)
    draft = session.chain.draft(history, min(draft_max, fits), limit, fits)
    proposal = draft.tokens if draft else []
    drafter = session.chain.last  # whose draft it is (None: no draft)
    verify = len(proposal)
    if adaptive is not None and proposal:
        adaptive.observe_draft(drafter, len(proposal), time.perf_counter() - drafting - draft.catch_up_seconds,
                               draft.catch_up_seconds)
        busy += time.perf_counter() - started
        verify = yield Propose(adaptive, drafter, len(proposal), len(pending), session.cache.length)
        started = time.perf_counter()
    drafted = proposal[:verify]  # [k]
    probs = draft.probs[:verify] if drafted and draft.probs is not None else None

    # verify: the pending tokens and the draft in one forward
    rows = Rows(session.cache, pending + drafted, len(drafted) + 1, generating=True)
    busy += time.perf_counter() - started
    try:
        logits = yield rows  # [k+1, vocab]
    except GeneratorExit:  # cancelled between the forward and its acceptance: the cache keeps only the history
        session.crop_cache(len(history))
        raise
    started = time.perf_counter()
    if constraint is not None:
        constraint.mask(logits, drafted)
    sampler.bias(logits)
    # the path's own argmax (rows.targets) unless a constraint or a logit bias changed the logits
    targets = rows.targets if constraint is None and not sampler.params.logit_bias else None
    accepted, next_token = sampler.verify(logits, drafted, probs, targets)
    if adaptive is not None and proposal:
        adaptive.observe(drafter, proposal, verify, accepted, next_token)

    # accept the agreeing prefix plus the target's own token; never emit past an EOS or the budget
    new_tokens = drafted[:accepted] + [next_token]
    finished = None
    for index, token in enumerate(new_tokens):
        if token in eos_ids:
            new_tokens, finished = new_tokens[: index + 1], "eos"
            break
    if len(new_tokens) >= budget:
        new_tokens, finished = new_tokens[:budget], finished or "length"
    accepted = min(accepted, len(new_tokens))

    if constraint is not None:
        constraint.advance(new_tokens)
    session.append(new_tokens)
    session.crop_cache(session.length - 1)  # rejected draft tokens leave the cache; the last token is pending
    if session.length >= context:
        finished = finished or "length"
    session.chain.accept(session.history, len(drafted), accepted)
    if adaptive is not None:
        # a draft held back whose first token the target chose anyway would have saved a step: that credit lets
        # a held-back drafter back in once its drafts turn right (its alpha then climbs by these free checks)
        right = bool(proposal) and not drafted and proposal[0] == next_token
        price(adaptive, session.chain.called, drafter, len(pending), len(drafted), accepted + right,
              busy + time.perf_counter() - started)
    logprobs = (token_logprobs(logits, new_tokens, sampler.params.logprobs) if sampler.params.logprobs >= 0
                else None)
    return Step(new_tokens, len(drafted), accepted, rows.seconds, finished, logprobs)


def price(adaptive: Adaptive, called: list[tuple[str, float]], drafter: str | None, pending: int, verified: int,
          accepted: int, busy: float) -> None:
    """What the step taught about its price: the host's own seconds (all but the drafters' calls), each called
    drafter's seconds, and what the winning draft saved: a plain step's price per accepted token, less what its
    verified rows added to the forward (a draft none of which was verified: what its first token would have saved,
    when it was right)."""
    shared, costs = adaptive.shared, adaptive.costs
    shared.observe_host(max(busy - sum(seconds for _, seconds in called), 0.0))
    plain = costs.cost(max(pending, 1))
    rows = max(verified, accepted)  # a held-back draft that was right: as if its first token had been verified
    saved = accepted * (plain + shared.host) - (costs.cost(pending + rows) - plain if rows else 0.0)
    adaptive.observe_calls(called, drafter, saved)


def decode_steps(session: Session, prompt: list[int], sampler: Sampler, draft_max: int,
                 max_tokens: int, context: int, eos_ids: frozenset[int],
                 stats: GenerationStats, adaptive: Adaptive | None = None, prefill_chunk: int = 0,
                 constraint: Constraint | None = None) -> Iterator[Step]:
    """Run steps until EOS, max_tokens or the context is full, updating `stats` as it goes. A generator of
    Steps, with the steps' requests for a driver in between (generate_steps drives it alone). prefill_chunk:
    the prompt tokens that are not cached yet go in forwards of at most that many, so a driver can run other
    sessions' steps in between (0: in one forward; up to SHORT_PROMPT of them go with the first step)."""
    started = time.perf_counter()
    stats.prompt_tokens = len(prompt)
    stats.cached_tokens = session.prepare(prompt)
    if prefill_chunk > 0 or len(session.pending) > SHORT_PROMPT:
        for rows in prefill_rows(session, prefill_chunk):
            yield rows
            stats.forward_seconds += rows.seconds
    session.chain.begin(session.history, sampler.params)
    while True:
        step = yield from speculative_step(session, sampler, draft_max, max_tokens - stats.generated_tokens, context,
                                           eos_ids, adaptive, constraint)
        if stats.target_forwards == 0:
            stats.prefill_seconds = time.perf_counter() - started
        stats.target_forwards += 1
        stats.generated_tokens += len(step.tokens)
        stats.drafted_tokens += step.drafted
        stats.accepted_tokens += step.accepted
        stats.forward_seconds += step.forward_seconds
        stats.seconds = time.perf_counter() - started
        yield step
        if step.finished:
            return


SHORT_PROMPT = 16  # uncached prompt tokens that go with the first step, not in a forward of their own (one that
# the lean path may run in bfloat16: LeanLlama.prompt_weights)


INVARIANT_CHUNK = 128


def prefill_rows(session: Session, chunk: int):
    """Forward requests that cache a prepared session's uncached prompt, at most `chunk` tokens each (0: one). The
    last prompt token stays pending: the first step needs its logits."""
    cold = session.pending[:-1]
    # (0 on an invariant path: chunks of INVARIANT_CHUNK, the same bits, and faster than one long forward there:
    # a 400-token prompt 2.3 -> 1.8 s on an AVX2 CPU)
    step = chunk if chunk > 0 else INVARIANT_CHUNK if getattr(session.path, "invariant", False) else max(len(cold), 1)
    for start in range(0, len(cold), step):
        yield Rows(session.cache, cold[start : start + step], 1, prompt=True)


def generate_steps(session: Session, prompt: list[int], sampler: Sampler, draft_max: int,
                   max_tokens: int, context: int, eos_ids: frozenset[int],
                   stats: GenerationStats, adaptive: Adaptive | None = None) -> Iterator[Step]:
    """decode_steps, alone: its Steps."""
    return drive(decode_steps(session, prompt, sampler, draft_max, max_tokens, context, eos_ids, stats, adaptive),
                 session.path, adaptive.costs if adaptive is not None else None)
