"""One generation for a route: prompt ids built on the engine's worker, a session picked, a job submitted, its text
filtered as it streams, and its timings and speculation statistics afterwards.

Sessions. A request may name one (`session`, or llama.cpp's `id_slot` N, which is session "slot-N"). One that names
none gets, like llama.cpp's slot selection, the idle one of `slots` sessions whose history shares the longest
prefix with its prompt, so an editor that sends one file's context again and again reuses its cache without
knowing about sessions. When every slot is busy it runs in a fresh temporary session instead of waiting.

With several API keys, each key's sessions and slots are its own (their names start with the key's `tenant`
prefix): a client can neither reuse another key's cache nor learn from tokens_cached how much of a guess matched
another key's prompt.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ..config import SamplingParams, ServerConfig, SpecConfig
from ..decode import next_output
from ..engine import KEEP
from ..errors import CodespecError
from ..forward import Rows
from ..stats import GenerationStats
from .postprocess import OutputFilter

MIN_REUSE = 8  # shared prompt tokens that make a slot worth reusing over an empty one
UNLIMITED_ROOM = 256  # context kept free for the text when a request sets no limit (/infill cuts its prompt to fit)


@dataclass
class Prompt:
    ids: list[int]
    truncated: bool = False  # context was cut to fit (infill)
    stop_ids: frozenset[int] = frozenset()
    limits: list = field(default_factory=list)  # postprocess limits (cut/safe), e.g. the FIM fallback's suffix
    healed: str | None = None  # token healing: a token string the output spells first (not sent: the prompt had it)


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


@dataclass
class Run:
    plan: Plan
    prompt: Prompt
    session_id: str
    temporary: bool
    arrived: float
    job: object = None
    cached: int = 0  # prompt tokens reused from the session
    steps_started: float | None = None
    prefill_done: float | None = None
    first_token_at: float | None = None
    result: object = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    stopping_word: str = ""
    filter: OutputFilter | None = None
    limited: bool = False  # a limit (suffix, indentation, time) ended the text
    cancelled: bool = False

    @property
    def text(self) -> str:
        return self.filter.final_text

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
        warm_s = (self.prefill_done or 0) - (self.steps_started or 0)
        prompt_ms = (max(warm_s, 0.0) + stats.prefill_seconds) * 1e3
        predicted_ms = max(stats.seconds - stats.prefill_seconds, 0.0) * 1e3
        prompt_n, predicted_n = len(self.prompt.ids) - self.cached, stats.generated_tokens
        return {"prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
                "prompt_per_second": round(1e3 * prompt_n / prompt_ms, 3) if prompt_ms else 0.0,
                "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_token_ms": round(predicted_ms / predicted_n, 3) if predicted_n else 0.0,
                "predicted_per_second": round(1e3 * predicted_n / predicted_ms, 3) if predicted_ms else 0.0}

    def speculation(self) -> dict:
        stats = self.stats.to_dict()
        keys = ("target_forwards", "drafted_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_forward",
                "drafters")
        return {"spec": list(self.plan.spec.spec), **{key: stats[key] for key in keys}}


class Generations:
    def __init__(self, scheduler, metrics, config: ServerConfig, params: SamplingParams, spec: SpecConfig):
        self.scheduler, self.metrics, self.config = scheduler, metrics, config
        self.params, self.spec = params, spec
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
        if body.requested_tokens() != 0:
            updates["max_tokens"] = self.token_limit(body.requested_tokens())
        spec_updates = {name: getattr(body, name) for name in ("draft_max", "draft_min")
                        if getattr(body, name) is not None}
        if body.spec is not None:
            spec_updates["spec"] = tuple(body.spec)
        params, spec = replace(self.params, **updates), replace(self.spec, **spec_updates)
        if "draft_max" in spec_updates and "draft_min" not in spec_updates:
            spec = replace(spec, draft_min=min(spec.draft_min, spec.draft_max))
        try:
            params.validate()
            spec.validate()
        except ValueError as exc:
            raise CodespecError(str(exc)) from None
        return params, spec

    @staticmethod
    def session_name(body, tenant: str = "") -> str | None:
        if body.session is not None:
            return tenant + body.session
        return f"{tenant}slot-{body.id_slot}" if body.id_slot >= 0 else None

    async def start(self, plan: Plan) -> Run:
        """Build the prompt, pick the session and submit, all on the worker (so no two requests pick the same idle
        slot). Raises CodespecError (400) for a bad prompt and QueueFull (429)."""
        return await self.scheduler.acall(self._start, plan, time.perf_counter())

    def _start(self, engine, plan: Plan, arrived: float) -> Run:
        prompt = plan.build(engine)
        if len(prompt.ids) >= engine.context_length:
            raise CodespecError(f"the prompt is {len(prompt.ids)} tokens but the model's context is "
                                f"{engine.context_length}")
        if not prompt.ids and not plan.warm_only:
            raise CodespecError("the prompt is empty")
        self.warmups = {name: job for name, job in self.warmups.items() if not job.done}
        session_id, temporary = self._pick(engine, plan, prompt.ids)
        run = Run(plan, prompt, session_id, temporary, arrived)
        run.filter = OutputFilter(prompt.limits, plan.t_max_predict_ms)
        run.job = self.scheduler.submit_steps(lambda engine: self._steps(engine, run), session_id=session_id)
        superseded = self.warmups.pop(session_id, None)  # (a request refused with 429 above supersedes nothing)
        if superseded is not None:
            # A newer request on this session: its warm-up ends at its next chunk, and what it computed stays in
            # the cache. The newer prompt reuses that (llama.vim's instruction shares its warm-up's start) instead
            # of waiting for the rest of a prefill that it would throw away or do itself anyway.
            superseded.cancel()
        if plan.warm_only and not temporary:
            self.warmups[session_id] = run.job
        return run

    def _pick(self, engine, plan: Plan, ids: list[int]) -> tuple[str, bool]:
        if not plan.cache_prompt:
            return f"tmp-{uuid.uuid4().hex}", True
        if plan.session is not None:
            return plan.session, False
        # a slot that only runs a warm-up is free: the warm-up gives way (_start), and its cache may be this prompt's
        warming = {name for name, job in self.warmups.items() if job.started_at is not None}
        busy = self.scheduler.busy_sessions() - warming
        slots = [f"{plan.tenant}slot-{i}" for i in range(self.config.slots)]
        idle = [name for name in slots if name not in busy]
        if not idle:
            return f"tmp-{uuid.uuid4().hex}", True
        held = {info.id: (rank, info) for rank, info in enumerate(engine.sessions_info(plan.tenant))}  # LRU first

        def score(name):
            """Longest shared prefix first (a few tokens is chance, not reuse); then an unused slot, whose cache
            nobody loses; then the least recently used."""
            if name not in held:
                return (0, 1)
            rank, info = held[name]
            shared = common_prefix(info.history, ids)
            return (shared if shared >= MIN_REUSE else 0, -rank - 1)

        return max(idle, key=score), False

    def _steps(self, engine, run: Run):
        """The job: prefill in chunks, then generate. Each chunk and each step is a forward request that the
        scheduler runs in one batch with the other jobs' (decode.py)."""
        plan = run.plan
        run.steps_started = time.perf_counter()
        try:
            if run.prompt.ids:
                warm = engine.prefill_steps(run.prompt.ids, run.session_id, plan.spec,
                                            chunk_tokens=self.config.prefill_chunk)
                run.cached = next(warm)
                for item in warm:
                    if isinstance(item, Rows):
                        yield item  # no logits come back for a prefill: its keys and values are what it is for
            run.prefill_done = time.perf_counter()
            if plan.warm_only:
                return
            steps = engine.stream_steps(run.prompt.ids, plan.params, session_id=run.session_id, spec=plan.spec,
                                        stop_ids=run.prompt.stop_ids, healed=run.prompt.healed)
            while (chunk := (yield from next_output(steps))) is not None:
                if chunk.result is not None and chunk.result.finish_reason == "stop":
                    said = engine.tokenizer.decode(chunk.result.tokens, skip_special_tokens=True)
                    run.stopping_word = next((s for s in plan.params.stop if s and s in said), "")
                yield chunk
        finally:
            if run.temporary:
                engine.drop(run.session_id, pool=KEEP)  # a one-off request's text still teaches the pool

    async def deltas(self, run: Run) -> AsyncIterator[str]:
        """The text to send, piece by piece; afterwards run holds the result, statistics and stop reason. Stops the
        job early when a limit ends the text; cancels it when the consumer goes away."""
        items = run.job.__aiter__()
        try:
            async for item in items:
                if run.first_token_at is None:
                    run.first_token_at = time.perf_counter()
                    self.metrics.first_token.labels(run.plan.route).observe(run.first_token_at - run.arrived)
                run.stats = item.stats or run.stats
                run.result = item.result or run.result
                out, stop = run.filter.feed(item.text)
                if out:
                    yield out
                if stop:
                    run.limited = True
                    break
            rest = run.filter.finish()
            run.limited = run.limited or run.filter.stopped
            if rest:
                yield rest
        finally:
            await items.aclose()
            if not run.job.done:
                run.job.cancel()
                run.cancelled = True
            self._observe(run)

    async def collect(self, run: Run) -> Run:
        async for _ in self.deltas(run):
            pass
        return run

    def _observe(self, run: Run) -> None:
        if run.job.started_at is not None:
            self.metrics.queue_wait.observe(run.job.started_at - run.job.submitted_at)
        if run.cancelled and not run.limited:
            self.metrics.cancelled.inc()
        stats = run.result.stats if run.result is not None else run.stats
        stats.prompt_tokens, stats.cached_tokens = len(run.prompt.ids), run.cached
        self.metrics.observe_generation(run.plan.route, stats, stats.drafters)


def common_prefix(history: np.ndarray, ids: list[int]) -> int:
    length = min(len(history), len(ids))
    mismatch = np.flatnonzero(history[:length] != np.asarray(ids[:length], dtype=np.int64))
    return int(mismatch[0]) if mismatch.size else length
