"""The scheduler (one worker owns the engine; jobs take turns) and the engine's session eviction and warming."""

import asyncio
import threading

import numpy as np
import pytest

from codespec.config import SamplingParams
from codespec.errors import CodespecError
from codespec.scheduler import QueueFull, Scheduler
from tests.conftest import random_prompt

PARAMS = SamplingParams(max_tokens=32)


def prompts(count, length=40):
    rng = np.random.default_rng(7)
    return [random_prompt(rng, length, repetitive=True) for _ in range(count)]


@pytest.fixture
def scheduler(engine):
    scheduler = Scheduler(engine)
    yield scheduler
    scheduler.close()


def block_worker(scheduler):
    """Hold the worker inside a call until the returned event is set (makes queue states deterministic)."""
    gate, inside = threading.Event(), threading.Event()

    def hold(engine):
        inside.set()
        gate.wait(10)

    threading.Thread(target=scheduler.call, args=(hold,), daemon=True).start()
    inside.wait(10)
    return gate


def test_concurrent_jobs_equal_sequential_generation(engine, scheduler):
    batch = prompts(6)
    expected = [engine.generate(p, PARAMS).tokens for p in batch]
    jobs = [scheduler.submit(p, PARAMS) for p in batch]
    assert [job.wait().tokens for job in jobs] == expected
    assert scheduler.active == scheduler.queued == 0
    assert scheduler.batched_ticks > 0  # their steps really shared forwards


def test_jobs_with_different_drafters_and_a_cold_prompt_batch_together_and_match_alone(engine, scheduler):
    from codespec.config import SpecConfig

    rng = np.random.default_rng(11)
    work = [(random_prompt(rng, 40, repetitive=True), SpecConfig(spec=("prompt-lookup",), ngram_min=1)),
            (random_prompt(rng, 300, repetitive=False), SpecConfig(spec=("none",))),  # prefilled in chunks
            (random_prompt(rng, 60, repetitive=True), SpecConfig(spec=("ngram-mod", "prompt-lookup"))),
            (random_prompt(rng, 20, repetitive=False), SpecConfig(spec=("ngram-map-k",), ngram_min=1))]
    expected = [engine.generate(p, PARAMS, spec=spec).tokens for p, spec in work]
    gate = block_worker(scheduler)  # all four start in the same tick
    jobs = [scheduler.submit(p, PARAMS, spec=spec) for p, spec in work]
    gate.set()
    assert [job.wait().tokens for job in jobs] == expected
    assert scheduler.batched_ticks >= 8


def test_async_iteration_streams_the_same_text(engine, scheduler):
    prompt = prompts(1)[0]
    expected = engine.generate(prompt, PARAMS)

    async def consume():
        job = scheduler.submit(prompt, PARAMS)
        return [chunk async for chunk in job], job

    chunks, job = asyncio.run(consume())
    assert "".join(c.text for c in chunks) == expected.text and job.result.tokens == expected.tokens


def test_short_job_finishes_before_a_long_one_submitted_first(scheduler):
    gate = block_worker(scheduler)
    long_prompt, short_prompt = prompts(2)
    long_job = scheduler.submit(long_prompt, SamplingParams(max_tokens=200))
    short_job = scheduler.submit(short_prompt, SamplingParams(max_tokens=4))
    gate.set()
    short_job.wait()
    assert not long_job.done, "the short job waited for the long one"
    assert long_job.wait().stats.generated_tokens > 4


def test_jobs_on_one_session_do_not_interleave(engine, scheduler):
    first, second = prompts(2)
    gate = block_worker(scheduler)
    a = scheduler.submit(first, PARAMS, session_id="s")
    b = scheduler.submit(first + second, PARAMS, session_id="s")
    c = scheduler.submit(second, PARAMS)  # another session passes the waiting one
    gate.set()
    c.wait()
    assert not b.started_at or b.started_at >= a.finished_at
    b.wait()
    assert b.started_at >= a.finished_at
    assert b.result.stats.cached_tokens >= len(first) - 1  # b reused a's cache: they ran one after the other
    assert b.result.tokens == engine.generate(first + second, PARAMS).tokens


def test_cancel_frees_the_slot_and_keeps_the_session_usable(engine, scheduler):
    prompt = prompts(1)[0]
    job = scheduler.submit(prompt, SamplingParams(max_tokens=300), session_id="c")
    chunks = iter(job)
    next(chunks)
    job.cancel()
    rest = list(chunks)
    assert job.cancelled and job.result is None and len(rest) < 300
    follow = scheduler.submit(prompt, PARAMS, session_id="c").wait()
    assert follow.tokens == engine.generate(prompt, PARAMS).tokens
    assert scheduler.active == scheduler.queued == 0


def test_cancelled_before_start_never_runs(scheduler):
    gate = block_worker(scheduler)
    job = scheduler.submit(prompts(1)[0], PARAMS)
    job.cancel()
    gate.set()
    assert job.wait() is None and job.started_at is None


def test_queue_bound(engine):
    scheduler = Scheduler(engine, max_queue=2, max_active=1)
    try:
        gate = block_worker(scheduler)
        jobs = [scheduler.submit(p, PARAMS) for p in prompts(2)]
        with pytest.raises(QueueFull):
            scheduler.submit(prompts(1)[0], PARAMS)
        gate.set()
        assert all(job.wait() is not None for job in jobs)
        scheduler.submit(prompts(1)[0], PARAMS).wait()  # room again
    finally:
        scheduler.close()


def test_engine_errors_reach_the_consumer_and_the_worker_goes_on(engine, scheduler):
    with pytest.raises(CodespecError, match="context"):
        scheduler.submit(list(range(1, 300)) * 3, PARAMS).wait()
    with pytest.raises(CodespecError, match="max-tokens"):
        scheduler.submit(prompts(1)[0], SamplingParams(max_tokens=0)).wait()
    with pytest.raises(ZeroDivisionError):
        scheduler.call(lambda engine: 1 / 0)
    assert scheduler.call(lambda engine, x: x * 2, 21) == 42
    assert scheduler.submit(prompts(1)[0], PARAMS).wait() is not None


def test_warm_then_generate_equals_cold_and_reuses_the_cache(engine):
    prompt = prompts(1, length=120)[0]
    cold = engine.generate(prompt, PARAMS)
    assert list(engine.warm(prompt[:100], "w", chunk_tokens=32)) == [0, 32, 64, 96, 99]
    warm = engine.generate(prompt, PARAMS, session_id="w")
    assert warm.tokens == cold.tokens and warm.stats.cached_tokens == 99


def test_lru_eviction_under_a_memory_bound_spares_busy_sessions(engine):
    for name in "abc":
        engine.generate(prompts(1)[0], PARAMS, session_id=name)
    one = engine.sessions["a"].nbytes
    engine.session("a")  # a is now the most recently used
    engine.session_memory = 2 * one
    assert engine.evict() == ["b"] and list(engine.sessions) == ["c", "a"]
    engine.session_memory = 0
    assert engine.evict(keep={"a"}) == ["c"] and list(engine.sessions) == ["a"]


def test_scheduler_evicts_idle_sessions_after_each_job(engine, scheduler):
    engine.session_memory = 0
    scheduler.submit(prompts(1)[0], PARAMS, session_id="x").wait()
    assert scheduler.call(lambda engine: list(engine.sessions)) == []


def test_a_job_whose_steps_are_a_plain_iterator_runs_and_the_worker_goes_on(engine, scheduler):
    """submit_steps takes any iterable; a list iterator (no send, no close) used to end in an AttributeError that
    was raised again by the worker's own cleanup, which killed the worker."""
    assert list(scheduler.submit_steps(lambda engine: iter(["a", "b"]))) == ["a", "b"]
    assert list(scheduler.submit_steps(lambda engine: ["c"])) == ["c"]
    assert scheduler.call(lambda engine: 42) == 42
    assert scheduler.submit(prompts(1)[0], PARAMS).wait() is not None


def test_the_worker_frees_reference_cycles_that_requests_leave_behind(engine, monkeypatch):
    """A cycle holding a tensor (as a disconnected stream's frames hold logits) is freed soon after its job ends,
    and a finished job no longer holds the function that made its steps (a frontend's run refers to the job)."""
    import gc
    import weakref

    import torch

    monkeypatch.setattr(Scheduler, "COLLECT_SECONDS", 0.0)
    scheduler = Scheduler(engine)
    tensors = []

    def steps(engine):
        cycle = {"logits": torch.zeros(1 << 16)}
        cycle["self"] = cycle
        tensors.append(weakref.ref(cycle["logits"]))
        yield from ()  # a generator that ends at once, leaving the cycle behind

    gc.disable()  # only the worker's collections may free it
    try:
        job = scheduler.submit_steps(steps)
        job.wait()
        scheduler.call(lambda engine: None)  # the worker has retired the job by the time it answers a call
        assert tensors and tensors[0]() is None
        assert job._make_steps is None
    finally:
        gc.enable()
        scheduler.close()
