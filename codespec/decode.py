"""The speculative step: draft -> verify every draft token in one target forward -> accept.

Greedy output is token-for-token the output of plain greedy decoding; sampled output has the target's
distribution (see sampling.py). Drafters change how many tokens one forward yields, never which.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass


from .adaptive import Adaptive
from .sampling import Sampler
from .session import Session
from .stats import GenerationStats


@dataclass
class Step:
    tokens: list[int]  # tokens this step appended to the history
    drafted: int  # draft tokens that were verified
    accepted: int  # of those, tokens the target agreed with
    forward_seconds: float  # the target forward and the accept decision (which waits for its logits)
    finished: str | None = None  # "eos" or "length" when generation must stop here


def speculative_step(session: Session, sampler: Sampler, draft_max: int, budget: int,
                     context: int, eos_ids: frozenset[int], adaptive: Adaptive | None = None) -> Step:
    """One step: at most `budget` new tokens, never past `context` positions or past an EOS.
    With `adaptive`, only as much of the draft is verified as pays on this device (maybe none)."""
    history = session.history
    room = context - len(history)  # positions left for draft tokens plus the target's own token
    pending = session.pending
    limit = adaptive.draft_limit(len(pending)) if adaptive is not None else None
    started = time.perf_counter()
    draft = session.chain.draft(history, min(draft_max, budget - 1, room - 1), limit)
    proposal = draft.tokens if draft else []
    drafter = session.chain.last  # whose draft it is (None: no draft)
    verify = len(proposal)
    if adaptive is not None and proposal:
        adaptive.observe_draft(drafter, len(proposal), time.perf_counter() - started - draft.catch_up_seconds)
        verify = adaptive.length(drafter, len(proposal), len(pending))
    drafted = proposal[:verify]  # [k]
    probs = draft.probs[:verify] if drafted and draft.probs is not None else None

    # verify: the pending tokens and the draft in one forward
    started = time.perf_counter()
    logits = session.path(session.cache, pending + drafted, len(drafted) + 1)  # [k+1, vocab]
    accepted, next_token = sampler.verify(logits, drafted, probs)
    forward_seconds = time.perf_counter() - started
    if adaptive is not None:
        adaptive.costs.observe(len(pending) + len(drafted), forward_seconds)
        if proposal:
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

    session.append(new_tokens)
    session.crop_cache(session.length - 1)  # rejected draft tokens leave the cache; the last token is pending
    if session.length >= context:
        finished = finished or "length"
    session.chain.accept(session.history, len(drafted), accepted)
    return Step(new_tokens, len(drafted), accepted, forward_seconds, finished)


def generate_steps(session: Session, prompt: list[int], sampler: Sampler, draft_max: int,
                   max_tokens: int, context: int, eos_ids: frozenset[int],
                   stats: GenerationStats, adaptive: Adaptive | None = None) -> Iterator[Step]:
    """Run steps until EOS, max_tokens or the context is full, updating `stats` as it goes."""
    started = time.perf_counter()
    stats.prompt_tokens = len(prompt)
    stats.cached_tokens = session.prepare(prompt)
    session.chain.begin(session.history, sampler.params)
    while True:
        step = speculative_step(session, sampler, draft_max, max_tokens - stats.generated_tokens, context, eos_ids,
                                adaptive)
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
