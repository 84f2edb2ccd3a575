"""The request layer below both frontends (codespec.request): prompt -> session -> job with chunked prefill,
temporary sessions, the output filter's limits stopping the job, and statistics owned by the engine."""

import asyncio

import numpy as np
import pytest

from codespec.config import SamplingParams, SpecConfig
from codespec.errors import CodespecError
from codespec.request import Prompt, Request, Requests, apply_limits
from codespec.scheduler import Scheduler
from tests.conftest import random_prompt

PLAIN = SpecConfig(spec=("none",))


@pytest.fixture
def scheduler(engine):
    scheduler = Scheduler(engine)
    yield scheduler
    scheduler.close()


def prompt_ids(length=60, seed=3):
    return random_prompt(np.random.default_rng(seed), length, repetitive=True)


def run(requests, request):
    async def go():
        started = await requests.start(request)
        return await requests.collect(started)
    return asyncio.run(go())


class CutAfter:
    """A limit a frontend could plug in: the text ends after `chars` characters."""

    def __init__(self, chars):
        self.chars = chars

    def cut(self, text, final=False):
        return self.chars if len(text) >= self.chars else None

    def safe(self, text):
        return min(len(text), self.chars)


def test_the_text_is_the_engine_s_and_a_limit_stops_the_job(engine, scheduler):
    ids = prompt_ids()
    params = SamplingParams(max_tokens=40)
    alone = engine.generate(ids, params, spec=PLAIN)
    requests = Requests(scheduler)
    whole = run(requests, Request(lambda engine: Prompt(ids), params, PLAIN))
    assert whole.text == alone.text and whole.result.tokens == alone.tokens and not whole.limited

    limits = [CutAfter(len(alone.text) // 3)]
    cut = run(requests, Request(lambda engine: Prompt(ids, limits=limits), params, PLAIN))
    assert cut.text == apply_limits(alone.text, [CutAfter(len(alone.text) // 3)]) and cut.limited
    assert cut.finished and cut.result is None and cut.cancelled  # stopped at the cut: no tokens paid past it
    assert cut.stats.generated_tokens < whole.stats.generated_tokens


def test_temporary_sessions_go_and_named_ones_stay(engine, scheduler):
    requests = Requests(scheduler)
    params = SamplingParams(max_tokens=4)
    temporary = run(requests, Request(lambda engine: Prompt(prompt_ids()), params, PLAIN))
    named = run(requests, Request(lambda engine: Prompt(prompt_ids()), params, PLAIN, session="doc"))
    assert temporary.temporary and temporary.session_id.startswith("tmp-") and not named.temporary
    assert set(engine.sessions) == {"doc"}
    again = run(requests, Request(lambda engine: Prompt(prompt_ids() + [5, 6]), params, PLAIN,
                                  session=lambda engine, ids: "doc"))  # chosen on the worker from the ids
    assert again.session_id == "doc" and again.cached == len(prompt_ids())  # the engine counts what it reused


def test_statistics_are_the_engine_s_handed_out_as_snapshots(engine, scheduler):
    requests = Requests(scheduler)
    seen = []

    async def go():
        started = await requests.start(Request(lambda engine: Prompt(prompt_ids()), SamplingParams(max_tokens=24),
                                               PLAIN, session="s"))
        async for _ in requests.deltas(started):
            seen.append(started.stats)
        return started

    done = asyncio.run(go())
    assert len({id(stats) for stats in seen}) == len(seen)  # a new object each time: never one being written
    assert done.stats is not done.result.stats and done.stats.to_dict() == done.result.stats.to_dict()
    assert done.stats.prompt_tokens == len(prompt_ids()) and done.stats.generated_tokens == len(done.result.tokens)


def test_a_cold_prompt_is_prefilled_in_chunks_between_other_jobs_steps(engine, scheduler):
    ids = prompt_ids(length=100)
    before = scheduler.ticks
    run(Requests(scheduler, prefill_chunk=16), Request(lambda engine: Prompt(ids), SamplingParams(max_tokens=1),
                                                        PLAIN))
    assert scheduler.ticks - before == 7 + 1  # 99 cold tokens in 16-token forwards, then the one step


def test_a_warm_up_prefills_only_and_reports_it(engine, scheduler):
    ids = prompt_ids()
    warm = run(Requests(scheduler), Request(lambda engine: Prompt(ids), SamplingParams(), PLAIN, session="w",
                                            warm_only=True))
    assert warm.result is None and warm.text == "" and engine.sessions["w"].cached == len(ids) - 1
    assert (warm.stats.prompt_tokens, warm.stats.cached_tokens, warm.stats.generated_tokens) == (len(ids), 0, 0)
    assert warm.stats.prefill_seconds > 0


@pytest.mark.parametrize("ids, words", [([], "empty"), (list(range(1, 5000)), "context")])
def test_a_prompt_the_engine_cannot_take_is_refused_before_it_is_queued(engine, scheduler, ids, words):
    with pytest.raises(CodespecError, match=words):
        run(Requests(scheduler), Request(lambda engine: Prompt(ids), SamplingParams(), PLAIN))
    assert scheduler.queued == 0 and not engine.sessions


def test_the_language_server_s_local_backend_goes_through_the_same_layer(engine, scheduler):
    """An in-process LSP completion: the engine's text through the request's limits, the job stopped at the cut, the
    last piece final with the statistics."""
    from types import SimpleNamespace

    from codespec.context.fim import FimPrompt
    from lsp.backend import InfillRequest, LocalBackend

    ids = prompt_ids()
    alone = engine.generate(ids, SamplingParams(max_tokens=40), spec=PLAIN)

    async def ready():
        return scheduler

    prompts = SimpleNamespace(build=lambda engine, request: FimPrompt(list(ids), None))
    limits = [CutAfter(len(alone.text) // 2)]
    request = InfillRequest("lsp:a.py", "file:///a.py", "", "", (), [], (), None, "", [], 40, (), PLAIN, limits)

    async def go():
        return [piece async for piece in LocalBackend(ready, prompts).infill(request)]

    pieces = asyncio.run(go())
    assert "".join(piece.text for piece in pieces) == apply_limits(alone.text, [CutAfter(len(alone.text) // 2)])
    assert pieces[-1].final and not any(piece.final for piece in pieces[:-1])
    assert 0 < pieces[-1].stats.generated_tokens < alone.stats.generated_tokens
