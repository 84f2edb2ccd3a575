"""The request layer: one path from a frontend's prompt to its text, below the HTTP routes and the language server.

A frontend describes a `Request`: how to build its prompt (on the engine's worker: the tokenizer is the engine's),
the sampling and drafter settings, the session it runs in (a name, a choice made on the worker once the prompt's
tokens are known, or none: a temporary session), and whether it only warms the cache. `Requests.submit` builds and
checks the prompt, names the session and queues one job; the job prefills the uncached prompt in chunks between
other jobs' steps, then generates, and a temporary session goes when it ends (what it taught the shared pool
stays). `Requests.deltas` streams the text through the output filter (limits.py), stops the job as soon as a limit
has ended the text, and cancels it when the consumer goes away.

Statistics are written below this layer, by the engine; jobs hand out snapshots, so a frontend reading them on
another thread never sees one half-written. The only statistics written here are a warm-up's, which the engine
does not generate.

What stays with the frontends: llama.cpp's and OpenAI's fields, slot picking and warm-ups giving way
(server/generation.py); document windows, tree-sitter's decisions and other files' chunks (lsp/completion.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import closing
from dataclasses import dataclass, field, replace

from ..config import SamplingParams, ServerConfig, SpecConfig
from ..decode import next_output
from ..engine import KEEP
from ..errors import CodespecError
from ..forward import Rows
from ..stats import GenerationStats
from .limits import OutputFilter, TimeLimit


@dataclass
class Prompt:
    ids: list[int]
    truncated: bool = False  # context was cut to fit the budget (context.fim.prompt_budget)
    stop_ids: frozenset[int] = frozenset()  # tokens that end the text like an EOS (a FIM format's)
    limits: list = field(default_factory=list)  # output limits (limits.py), e.g. the FIM fallback's suffix
    healed: str | None = None  # token healing: a token string the output spells first (not sent: the prompt had it)
    reference: list[int] | None = None  # the tokens of a text this generation rewrites (the edit-align drafter)


@dataclass
class Request:
    build: Callable  # build(engine) -> Prompt, on the worker
    params: SamplingParams
    spec: SpecConfig
    session: str | Callable | None = None  # a name; session(engine, prompt ids) -> a name or None; None: temporary
    warm_only: bool = False  # only prefill the session's cache (n_predict 0)
    t_max_predict_ms: int = 0  # llama.cpp's time limit (limits.TimeLimit); 0: none
    fork_to: tuple[str, ...] = ()  # sessions that start from this one's cached prompt once it has it (n_cmpl)
    drop_after: bool = False  # a named session that goes when this request ends, as a temporary one (n_cmpl's)


@dataclass
class Run:
    """A submitted request: its job, then its result, statistics and how it ended."""

    request: Request
    prompt: Prompt
    session_id: str
    temporary: bool  # a session of its own, dropped when it ends
    filter: OutputFilter
    job: object = None  # scheduler.Job
    stats: GenerationStats = field(default_factory=GenerationStats)  # the latest snapshot, final once it ended
    result: object = None  # engine.GenerationResult, when the engine finished it
    stop_word: str = ""  # the stop string that ended it
    limited: bool = False  # an output limit ended the text
    cancelled: bool = False  # its consumer went away (or a limit stopped it) before the job ended
    first_item_at: float | None = None  # when its first output arrived
    logprobs: list = field(default_factory=list)  # with SamplingParams.logprobs: every generated token's, so far

    @property
    def token_logprobs(self) -> list:
        """The answer's tokens' log-probabilities (decode.TokenLogprob): the engine's for its result's tokens, or,
        when a limit cut the text first, every token generated until then."""
        if self.result is not None and self.result.logprobs is not None:
            return self.result.logprobs
        return self.logprobs

    @property
    def text(self) -> str:
        return self.filter.final_text

    @property
    def cached(self) -> int:
        """Prompt tokens reused from the session's cache."""
        return self.stats.cached_tokens

    @property
    def finished(self) -> bool:
        """It ended by itself (EOS, a stop, a limit, the length), not cut off."""
        return self.result is not None or self.limited


class Requests:
    def __init__(self, scheduler, prefill_chunk: int = ServerConfig.prefill_chunk):
        self.scheduler = scheduler
        self.prefill_chunk = prefill_chunk  # prompt tokens per forward: other jobs take turns between chunks

    async def start(self, request: Request) -> Run:
        """Submit on the worker. Raises CodespecError for a bad prompt and scheduler.QueueFull."""
        return await self.scheduler.acall(self.submit, request)

    def submit(self, engine, request: Request, new_run: Callable | None = None) -> Run:
        """On the worker: build the prompt, check it, name the session, queue the job. new_run: a frontend's Run
        subclass, given Run's fields."""
        prompt = request.build(engine)
        if len(prompt.ids) >= engine.context_length:
            raise CodespecError(f"the prompt is {len(prompt.ids)} tokens but the model's context is "
                                f"{engine.context_length}")
        if not prompt.ids and not request.warm_only:
            raise CodespecError("the prompt is empty")
        session = request.session(engine, prompt.ids) if callable(request.session) else request.session
        limits = prompt.limits + ([TimeLimit(request.t_max_predict_ms)] if request.t_max_predict_ms else [])
        run = (new_run or Run)(request, prompt, session or f"tmp-{uuid.uuid4().hex}",
                               session is None or request.drop_after, OutputFilter(limits))
        run.job = self.scheduler.submit_steps(lambda engine: self._steps(engine, run), session_id=run.session_id)
        return run

    def _steps(self, engine, run: Run):
        """The job: prefill in chunks, then generate. Each chunk and each step is a forward request that the
        scheduler runs in one batch with the other jobs' (decode.py)."""
        request, prompt = run.request, run.prompt
        try:
            if request.warm_only:
                yield from self._warm(engine, run)
                return
            steps = engine.stream_steps(prompt.ids, request.params, session_id=run.session_id, spec=request.spec,
                                        reference=prompt.reference, stop_ids=prompt.stop_ids,
                                        prefill_chunk=self.prefill_chunk, healed=prompt.healed)
            forks = request.fork_to  # copied once, at the first chunk: the prompt is cached by then
            with closing(steps):  # a job stopped between two chunks ends the engine's generation there, at once
                while (chunk := (yield from next_output(steps))) is not None:
                    for other in forks:
                        engine.fork(run.session_id, other, prompt.ids, request.spec)
                    forks = ()
                    if chunk.result is not None and chunk.result.finish_reason == "stop":
                        said = engine.tokenizer.decode(chunk.result.tokens, skip_special_tokens=True)
                        run.stop_word = next((s for s in request.params.stop if s and s in said), "")
                    yield replace(chunk, stats=chunk.stats.copy() if chunk.stats is not None else None)
        finally:
            if run.temporary:
                engine.drop(run.session_id, pool=KEEP)  # a one-off request's text still teaches the pool

    def _warm(self, engine, run: Run):
        """Prefill only: no logits come back, its keys and values are what it is for."""
        started = time.perf_counter()
        stats = run.stats = GenerationStats(prompt_tokens=len(run.prompt.ids))
        try:
            if run.prompt.ids:
                warm = engine.prefill_steps(run.prompt.ids, run.session_id, run.request.spec,
                                            chunk_tokens=self.prefill_chunk)
                stats.cached_tokens = next(warm)
                for item in warm:
                    if isinstance(item, Rows):
                        yield item
        finally:  # a warm-up that a newer request superseded ends early: what it cached stays
            stats.prefill_seconds = stats.seconds = time.perf_counter() - started

    async def deltas(self, run: Run) -> AsyncIterator[str]:
        """The text to send, piece by piece; afterwards `run` holds the result, statistics and how it ended. Stops
        the job early when a limit ends the text; cancels it when the consumer goes away."""
        items = run.job.__aiter__()
        try:
            async for item in items:
                run.first_item_at = run.first_item_at or time.perf_counter()
                run.stats = item.stats or run.stats
                run.result = item.result or run.result
                run.logprobs += item.logprobs or []
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

    async def collect(self, run: Run) -> Run:
        async for _ in self.deltas(run):
            pass
        return run
