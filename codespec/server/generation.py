"""One generation for a route, on the request layer (codespec.request: prompt -> session -> job, output limits,
statistics): what is HTTP's is here, the session a request runs in (slots, warm-ups giving way), its settings from
the body, its metrics, and llama.cpp's and OpenAI's names for how it went (timings, stop type, finish reason).

Sessions. A request may name one (`session`, or llama.cpp's `id_slot` N, which is session "slot-N"). One that names
none gets, like llama.cpp's slot selection, the idle one of `slots` sessions whose history shares the longest
prefix with its prompt, so an editor that sends one file's context again and again reuses its cache without
knowing about sessions. When every slot is busy it runs in a fresh temporary session instead of waiting.

With several API keys, each key's sessions and slots are its own (their names start with the key's `tenant`
prefix): a client can neither reuse another key's cache nor learn from tokens_cached how much of a guess matched
another key's prompt.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace

import numpy as np

from ..config import SamplingParams, ServerConfig, SpecConfig
from ..engine import KEEP
from ..request import Request, Requests, Run
from .errors import Unsupported
from .llamacpp import fitting

MIN_REUSE = 8  # shared prompt tokens that make a slot worth reusing over an empty one


@dataclass
class Plan:
    """What a route asks for."""

    route: str
    build: Callable  # build(engine) -> Prompt, run on the worker (the tokenizer is the engine's)
    params: SamplingParams
    spec: SpecConfig
    session: str | None = None  # explicit session name
    cache_prompt: bool = True
    warm_only: bool = False  # n_predict 0
    t_max_predict_ms: int = 0
    tenant: str = ""  # the API key's session namespace ('' with none or one key)
    fork_to: tuple[str, ...] = ()  # the first alternative's: the other alternatives' sessions (n_cmpl)
    drop_after: bool = False  # an alternative's own session goes when it ends


@dataclass
class Generation(Run):
    """A route's run (the request layer's), in llama.cpp's and OpenAI's terms."""

    plan: Plan | None = None
    arrived: float = 0.0  # when the request reached the route

    @property
    def session_name(self) -> str:
        """The session's name as the client knows it (without the key's namespace)."""
        return self.session_id.removeprefix(self.plan.tenant)

    @property
    def stop_type(self) -> str:
        if self.limited:
            return "limit"
        if self.result is None:
            return "none"
        return {"eos": "eos", "stop": "word", "length": "limit"}[self.result.finish_reason]

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "length" when max_tokens or the context ended it, else "stop"."""
        return "length" if self.result is not None and self.result.finish_reason == "length" else "stop"

    def timings(self) -> dict:
        stats = self.stats
        prompt_ms = stats.prefill_seconds * 1e3  # the chunked prefill included: the time to the first token
        predicted_ms = max(stats.seconds - stats.prefill_seconds, 0.0) * 1e3
        prompt_n, predicted_n = stats.prompt_tokens - stats.cached_tokens, stats.generated_tokens
        return {"prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
                "prompt_per_second": round(1e3 * prompt_n / prompt_ms, 3) if prompt_ms else 0.0,
                "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_token_ms": round(predicted_ms / predicted_n, 3) if predicted_n else 0.0,
                "predicted_per_second": round(1e3 * predicted_n / predicted_ms, 3) if predicted_ms else 0.0,
                # llama-server's: prompt tokens reused from the cache, draft tokens verified and accepted
                "cache_n": stats.cached_tokens, "draft_n": stats.drafted_tokens,
                "draft_n_accepted": stats.accepted_tokens}

    def prediction_tokens(self) -> dict:
        """OpenAI's Predicted Outputs counts: the prediction's drafts (edit-align's) the model accepted and those it
        rejected (zero without a prediction)."""
        drafted = accepted = 0
        for drafter in self.stats.drafters:
            if drafter.name == "edit-align":
                drafted, accepted = drafted + drafter.gen_tokens, accepted + drafter.acc_tokens
        return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": drafted - accepted}

    def speculation(self) -> dict:
        stats = self.stats.to_dict()
        keys = ("target_forwards", "drafted_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_forward",
                "drafters")
        return {"spec": list(self.plan.spec.spec), **{key: stats[key] for key in keys}}


class Generations:
    def __init__(self, scheduler, metrics, config: ServerConfig, params: SamplingParams, spec: SpecConfig):
        self.scheduler, self.metrics, self.config = scheduler, metrics, config
        self.params, self.spec = params, spec
        self.requests = Requests(scheduler, config.prefill_chunk)
        self.warmups: dict[str, object] = {}  # session id -> its warm-up's job (n_predict 0), until a newer request

    def token_limit(self, requested: int) -> int:
        """The tokens a request may generate, as llama-server counts them: `requested` is its n_predict (else
        max_tokens; -1 when it sets neither), capped by the server's --n-predict; with neither, the rest of the
        context (generation also ends where the context does). Not for 0, which only warms the cache."""
        cap = self.config.n_predict if self.config.n_predict > 0 else self.scheduler.engine.context_length
        return min(requested, cap) if requested > 0 else cap

    def settings(self, body) -> tuple[SamplingParams, SpecConfig]:
        """The server's defaults with the request's overrides, validated (CodespecError: a 400)."""
        updates = {name: getattr(body, name) for name in ("temperature", "top_k", "top_p")
                   if getattr(body, name, None) is not None}
        if body.seed is not None:
            updates["seed"] = None if body.seed == -1 else body.seed
        if body.stop is not None:
            updates["stop"] = tuple(body.stop)
        if body.logprob_count() >= 0:
            updates["logprobs"] = body.logprob_count()
        if body.logit_bias:
            updates["logit_bias"] = self.bias_tokens(body.biases())
        if body.requested_tokens() != 0:
            updates["max_tokens"] = self.token_limit(body.requested_tokens())
        spec_updates = {name: getattr(body, name) for name in ("draft_max", "draft_min")
                        if getattr(body, name) is not None}
        if body.spec is not None:
            spec_updates["spec"] = tuple(body.spec)
        if "draft_max" in spec_updates:  # the request's own bound, with a prediction too
            spec_updates["prediction_draft_max"] = spec_updates["draft_max"]
            if "draft_min" not in spec_updates:
                spec_updates["draft_min"] = min(self.spec.draft_min, spec_updates["draft_max"])
        return replace(self.params, **updates), replace(self.spec, **spec_updates)  # (each checks itself)

    def bias_tokens(self, biases: list[tuple[int | str, float]]) -> tuple[tuple[int, float], ...]:
        """logit_bias's (token id or text, bias) as (token id, bias): a text's every token, as llama-server reads
        it; an id outside the vocabulary is a 400."""
        engine = self.scheduler.engine
        vocabulary = int(engine.model.config.vocab_size)
        pairs = []
        for key, bias in biases:
            tokens = engine.tokenizer.encode(key, add_special_tokens=False) if isinstance(key, str) else [key]
            if any(token >= vocabulary for token in tokens):
                raise Unsupported("logit_bias", f"token id {key} is outside the vocabulary (0..{vocabulary - 1})")
            pairs += [(token, bias) for token in tokens]
        return tuple(pairs)

    @staticmethod
    def session_name(body, tenant: str = "") -> str | None:
        if body.session is not None:
            return tenant + body.session
        return f"{tenant}slot-{body.id_slot}" if body.id_slot >= 0 else None

    async def start(self, plan: Plan) -> Generation:
        """Build the prompt, pick the session and submit, all on the worker (so no two requests pick the same idle
        slot). Raises CodespecError (400) for a bad prompt and QueueFull (429)."""
        return await self.scheduler.acall(self._start, plan, time.perf_counter())

    async def start_all(self, plan: Plan, count: int) -> list[Generation]:
        """`count` alternatives of one request (llama.cpp's n_cmpl, OpenAI's n), in order. The first runs as a
        request alone would; once it has cached the prompt (its first output), the others start from a copy of that
        cache (Session.fork: computed once), each in a temporary session, sampling with seeds one apart. They decode
        together, one batched forward a tick, and draft from one pool. Greedy alternatives are one text: the first
        run, `count` times in the list (runs_of gives each run once)."""
        if count == 1 or plan.warm_only or plan.params.temperature == 0:
            return [await self.start(plan)] * (1 if plan.warm_only else count)
        sessions = [f"{plan.tenant}tmp-{uuid.uuid4().hex}" for _ in range(count - 1)]
        first = await self.start(replace(plan, fork_to=tuple(sessions)))
        runs = [first]
        try:
            while first.job.produced == 0 and not first.job.done:  # (its first output: the prompt is cached)
                await asyncio.sleep(0.002)
            seed = plan.params.seed
            for index, session in enumerate(sessions, 1):
                params = plan.params if seed is None else replace(plan.params, seed=seed + index)
                runs.append(await self.start(replace(plan, params=params, session=session, cache_prompt=True,
                                                     drop_after=True)))
        except BaseException:  # (a full queue, a cancelled request): none of them runs on for nobody
            for run in runs:
                run.job.cancel()
            await self.scheduler.acall(lambda engine: [engine.drop(s, pool=KEEP) for s in sessions
                                                       if s not in self.scheduler.busy_sessions()])
            raise
        return runs

    @staticmethod
    def runs_of(alternatives: list[Generation]) -> list[tuple[Generation, list[int]]]:
        """Each distinct run of start_all's list, with the alternatives' indexes it answers."""
        groups: dict[int, tuple[Generation, list[int]]] = {}
        for index, run in enumerate(alternatives):
            groups.setdefault(id(run), (run, []))[1].append(index)
        return list(groups.values())

    def _start(self, engine, plan: Plan, arrived: float) -> Generation:
        self.warmups = {name: job for name, job in self.warmups.items() if not job.done}
        request = Request(fitting(plan.build), plan.params, plan.spec,
                          lambda engine, ids: self._pick(engine, plan, ids), plan.warm_only, plan.t_max_predict_ms,
                          plan.fork_to, plan.drop_after)
        run = self.requests.submit(engine, request, lambda *fields: Generation(*fields, plan=plan, arrived=arrived))
        superseded = self.warmups.pop(run.session_id, None)  # (a request refused with 429 supersedes nothing)
        if superseded is not None:
            # A newer request on this session: its warm-up ends at its next chunk, and what it computed stays in
            # the cache. The newer prompt reuses that (llama.vim's instruction shares its warm-up's start) instead
            # of waiting for the rest of a prefill that it would throw away or do itself anyway.
            superseded.cancel()
        if plan.warm_only and not run.temporary:
            self.warmups[run.session_id] = run.job
        return run

    def _pick(self, engine, plan: Plan, ids: list[int]) -> str | None:
        """The session a request runs in; None: a temporary one."""
        if not plan.cache_prompt:
            return None
        if plan.session is not None:
            return plan.session
        # a slot that only runs a warm-up is free: the warm-up gives way (_start), and its cache may be this prompt's
        warming = {name for name, job in self.warmups.items() if job.started_at is not None}
        busy = self.scheduler.busy_sessions() - warming
        slots = [f"{plan.tenant}slot-{i}" for i in range(self.config.slots)]
        idle = [name for name in slots if name not in busy]
        if not idle:
            return None
        held = {info.id: (rank, info) for rank, info in enumerate(engine.sessions_info(plan.tenant))}  # LRU first

        def score(name):
            """Longest shared prefix first (a few tokens is chance, not reuse); then an unused slot, whose cache
            nobody loses; then the least recently used."""
            if name not in held:
                return (0, 1)
            rank, info = held[name]
            shared = common_prefix(info.history, ids)
            return (shared if shared >= MIN_REUSE else 0, -rank - 1)

        return max(idle, key=score)

    async def deltas(self, run: Generation) -> AsyncIterator[str]:
        """The text to send, piece by piece (Requests.deltas), and the request's metrics once it ends."""
        try:
            async with aclosing(self.requests.deltas(run)) as deltas:  # closed: the job is cancelled at once
                async for delta in deltas:
                    yield delta
        finally:
            self._observe(run)

    async def collect(self, run: Generation) -> Generation:
        async for _ in self.deltas(run):
            pass
        return run

    def _observe(self, run: Generation) -> None:
        if run.first_item_at is not None:
            self.metrics.first_token.labels(run.plan.route).observe(run.first_item_at - run.arrived)
        if run.job.started_at is not None:
            self.metrics.queue_wait.observe(run.job.started_at - run.job.submitted_at)
        if run.cancelled and not run.limited:
            self.metrics.cancelled.inc()
        self.metrics.observe_generation(run.plan.route, run.stats, run.stats.drafters)


def common_prefix(history: np.ndarray, ids: list[int]) -> int:
    length = min(len(history), len(ids))
    mismatch = np.flatnonzero(history[:length] != np.asarray(ids[:length], dtype=np.int64))
    return int(mismatch[0]) if mismatch.size else length
