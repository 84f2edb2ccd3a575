"""The graph-safe forward (graphs.py): the lean forward's results with fixed shapes, greedy speculative output
identical to plain decoding in float32 and bfloat16, padding that nothing sees, caches handed on. On the device
CODESPEC_TEST_DEVICE names (cpu by default; cuda runs them with CUDA graphs)."""

import gc

import numpy as np
import pytest
import torch

from codespec.config import SamplingParams, SpecConfig
from codespec.engine import Engine
from codespec.errors import CodespecError
from codespec.forward import LeanLlama, Rows, forward_path
from codespec.forward.graphs import WIDTH, GraphLlama
from tests.conftest import random_prompt
from tests.tiny import DEVICE, EOS, tiny_arch_model, tiny_tokenizer

NONE = SpecConfig(spec=("none",))
LOOKUP = SpecConfig(spec=("prompt-lookup",), draft_max=WIDTH - 1, ngram_min=1, ngram_max=3)


def graph_path(kind="llama", dtype=torch.float64, context=512):
    model = tiny_arch_model(kind, dtype=dtype, context=context).to(DEVICE)
    return model, forward_path(model, graphs=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_the_graph_safe_forward_computes_the_lean_forwards_logits(kind):
    model, path = graph_path(kind)
    assert isinstance(path, GraphLlama) and path.graphs == (DEVICE == "cuda")
    lean = LeanLlama(model)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 384, 70).tolist()
    ours, theirs = path.new_cache(), lean.new_cache()
    # a prompt chunk (its own shapes), a generating forward over more rows than one width, then single tokens
    for ids, prompt_chunk in ((prompt[:40], True), (prompt[40:61], False), (prompt[61:62], False), (prompt[62:], False)):
        got = path.batch([Rows(ours, ids, len(ids), prompt=prompt_chunk)])[0]
        want = lean.batch([Rows(theirs, ids, len(ids), prompt=prompt_chunk)])[0]
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert ours.length == theirs.length == 70
    # the model's own forward, from scratch (transformers' softmax runs in float32)
    full = model(torch.tensor([prompt], device=model.device)).logits[0, -1:]
    ours.crop(69)
    torch.testing.assert_close(path(ours, prompt[69:], 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_logits_are_the_same_bits_decoded_alone_or_verified_among_others(dtype):
    """What keeps speculation lossless: every generating forward has the same shapes, so a row's logits do not
    depend on how many rows share its forward, nor on which other sequences share the batch."""
    _, path = graph_path(dtype=dtype)
    rng = np.random.default_rng(1)
    prompt, continuation = rng.integers(1, 384, 30).tolist(), rng.integers(1, 384, 9).tolist()
    alone, verified, other = path.new_cache(), path.new_cache(), path.new_cache()
    path(other, rng.integers(1, 384, 50).tolist(), 1)
    for cache in (alone, verified):
        path(cache, prompt, 1)
    one_at_a_time = torch.cat([path(alone, [token], 1) for token in continuation])
    together = path.batch([Rows(other, continuation[:3], 3, generating=True),
                           Rows(verified, continuation, len(continuation), generating=True)])[1]
    assert torch.equal(one_at_a_time, together)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_greedy_speculation_is_plain_decoding_token_for_token(dtype):
    model, _ = graph_path(dtype=dtype)
    engine = Engine(model, tiny_tokenizer(), SpecConfig(), eos_token_ids=frozenset({EOS}), forward="graphs")
    drafted = accepted = 0
    for seed in range(8):
        rng = np.random.default_rng(seed)
        prompt = random_prompt(rng, int(rng.integers(4, 120)), repetitive=seed % 4 != 0)
        plain = engine.generate(prompt, SamplingParams(max_tokens=48), spec=NONE)
        fast = engine.generate(prompt, SamplingParams(max_tokens=48), spec=LOOKUP)
        assert fast.tokens == plain.tokens, seed
        drafted, accepted = drafted + fast.stats.drafted_tokens, accepted + fast.stats.accepted_tokens
    assert 30 < accepted < drafted - 30  # drafts were both accepted and rejected


def test_padding_rows_and_rejected_drafts_leave_nothing_behind():
    _, path = graph_path()
    rng = np.random.default_rng(2)
    prompt, tail = rng.integers(1, 384, 20).tolist(), rng.integers(1, 384, 5).tolist()
    clean, used = path.new_cache(), path.new_cache()
    path(clean, prompt, 1)
    path(used, prompt, 1)
    path(used, rng.integers(1, 384, 12).tolist(), 12)  # a rejected draft, and its padding rows
    used.crop(20)
    assert torch.equal(path(used, tail, 5), path(clean, tail, 5))


def test_a_sessions_cache_goes_to_the_next_session_with_its_graph():
    _, path = graph_path()
    cache = path.new_cache()
    path(cache, [1, 2, 3], 1)
    slot = cache.slot
    del cache
    gc.collect()
    again = path.new_cache()
    assert again.slot == slot and again.length == 0
    assert path.new_cache().slot != slot


def test_a_prompt_past_the_context_is_refused_and_the_cache_stays_usable():
    _, path = graph_path(context=64)
    cache = path.new_cache()
    path(cache, list(range(1, 41)), 1)
    with pytest.raises(CodespecError, match="context of 64"):
        path(cache, list(range(1, 41)), 1)
    assert cache.length == 40
    other = path.new_cache()
    with pytest.raises(CodespecError, match="context of 64"):  # in a batch: the other sequence is untouched
        path.batch([Rows(other, [1, 2, 3], 1), Rows(cache, list(range(1, 41)), 1)])
    assert (cache.length, other.length) == (40, 0)
    assert path(cache, [5], 1).shape == (1, 384)


def test_seeded_sampling_repeats_on_the_graph_safe_forward():
    model, _ = graph_path(dtype=torch.float32)
    engine = Engine(model, tiny_tokenizer(), SpecConfig(), eos_token_ids=frozenset({EOS}), forward="graphs")
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=7)
    prompt = random_prompt(np.random.default_rng(3), 60, repetitive=True)
    first, second = (engine.generate(prompt, params, spec=LOOKUP).tokens for _ in range(2))
    assert first == second and len(first) > 8


def limit_caches(monkeypatch, engine, room: int):
    """From now on the device holds `room` more caches: the pool's growing fails as a GPU's allocation would."""
    from codespec.forward import graphs

    engine.costs  # measured first, on a cache of its own
    gc.collect()
    pool = engine.path.pool
    del pool.free[: max(len(pool.free) - room, 0)]

    def allocate(self, shape):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 MiB (simulated)")

    monkeypatch.setattr(graphs.Pool, "_allocate", allocate)


def test_a_full_device_makes_room_by_evicting_the_idlest_session(monkeypatch):
    model, _ = graph_path()
    engine = Engine(model, tiny_tokenizer(), SpecConfig(), eos_token_ids=frozenset({EOS}), forward="graphs")
    limit_caches(monkeypatch, engine, room=2)
    prompt, params = list(range(10, 40)), SamplingParams(max_tokens=8)
    first = engine.generate(prompt, params, session_id="a")
    engine.generate(prompt, params, session_id="b")
    again = engine.generate(prompt, params, session_id="c")  # "a" goes: its cache is c's now
    assert list(engine.sessions) == ["b", "c"] and again.tokens == first.tokens
    engine.sessions.clear()
    gc.collect()
    assert len(engine.path.pool.free) == 2


def test_a_full_device_with_nothing_to_evict_is_a_503_and_the_server_stays_up(monkeypatch):
    import httpx

    from codespec.config import ServerConfig
    from codespec.server import create_app
    from tests.serving import live_server

    model, _ = graph_path()
    engine = Engine(model, tiny_tokenizer(), SpecConfig(), eos_token_ids=frozenset({EOS}), forward="graphs")
    limit_caches(monkeypatch, engine, room=0)
    app = create_app(engine, ServerConfig(slots=1))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        for route in ("/v1/completions", "/completion"):
            answer = client.post(route, json={"prompt": "def f(x):", "max_tokens": 4})
            assert answer.status_code == 503, answer.text
            assert "no device memory" in answer.json()["error"]["message"]
        monkeypatch.undo()  # memory again: the same server answers
        assert client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4}).status_code == 200
        assert client.get("/health").status_code == 200


def test_a_draft_model_on_the_graph_safe_forward_drafts_on_the_device_the_same_tokens(monkeypatch):
    from codespec.drafters.draft_model import DraftModel

    model, path = graph_path(dtype=torch.float32)
    on_device, step_by_step = DraftModel(model, path=path), DraftModel(model, path=path)
    assert on_device._greedy_on_device()
    monkeypatch.setattr(step_by_step, "_greedy_on_device", lambda: False)
    calls = []
    greedy = path.greedy
    monkeypatch.setattr(path, "greedy", lambda *args: calls.append(args[2]) or greedy(*args))
    rng = np.random.default_rng(4)
    history = np.array(random_prompt(rng, 40, repetitive=True))
    for drafter in (on_device, step_by_step):
        drafter.begin(history, SamplingParams())
    for step in range(6):  # drafts, a partial acceptance each time, and a history that moves on
        first, second = on_device.draft(history, 7), step_by_step.draft(history, 7)
        assert first.tokens == second.tokens and len(first.tokens) == 7
        history = np.concatenate([history, first.tokens[: step % 4], rng.integers(1, 384, 1)])
        for drafter in (on_device, step_by_step):
            drafter.accept(history, 7, step % 4)
    assert calls == [7] * 6 and on_device.tokens == step_by_step.tokens


def test_ctx_size_sets_the_context_and_the_size_of_every_cache():
    model, _ = graph_path()
    engine = Engine(model, tiny_tokenizer(), SpecConfig(), eos_token_ids=frozenset({EOS}), forward="graphs",
                    context=128)
    assert engine.context_length == 128 and engine.path.context == 128
    assert engine.path.new_cache().keys.shape[2] == 256  # 128 + a width, in whole blocks
    with pytest.raises(CodespecError, match="context"):
        engine.generate(list(range(1, 200)), SamplingParams(max_tokens=4))
    result = engine.generate(list(range(1, 120)), SamplingParams(max_tokens=40), spec=NONE)
    assert len(result.tokens) == 128 - 119 and result.finish_reason == "length"


def prefilled(path, prompts):
    caches = [path.new_cache() for _ in prompts]
    for cache, prompt in zip(caches, prompts):
        path(cache, prompt, 1)
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sessions_stacked_in_one_forward_get_the_bits_each_gets_alone(monkeypatch, dtype):
    """One forward a tick for every session (a bucket of them, each in its own slot), and each session's logits
    the same bits as in a forward of its own: what keeps a batch of sessions lossless."""
    _, path = graph_path(dtype=dtype)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 384, int(rng.integers(3, 90))).tolist() for _ in range(11)]
    alone, stacked = prefilled(path, prompts), prefilled(path, prompts)
    forwards = []
    step = path.step
    monkeypatch.setattr(path, "step", lambda *args: forwards.append(args[1]) or step(*args))
    for _ in range(3):  # three ticks: every session verifies a draft of its own length
        rows = [rng.integers(1, 384, int(rng.integers(1, WIDTH + 1))).tolist() for _ in prompts]
        forwards.clear()
        together = path.batch([Rows(cache, ids, len(ids), generating=True) for cache, ids in zip(stacked, rows)])
        assert forwards == [16]  # 11 sessions: one forward of the 16-session bucket
        for cache, ids, got in zip(alone, rows, together):
            one = Rows(cache, ids, len(ids), generating=True)
            assert torch.equal(path.batch([one])[0], got)
    assert [c.length for c in stacked] == [c.length for c in alone]


def test_more_sessions_than_the_largest_bucket_run_in_more_forwards_with_the_same_bits(monkeypatch):
    _, path = graph_path(dtype=torch.float32)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(1, 384, 20).tolist() for _ in range(19)]
    alone, stacked = prefilled(path, prompts), prefilled(path, prompts)
    forwards = []
    step = path.step
    monkeypatch.setattr(path, "step", lambda *args: forwards.append(args[1]) or step(*args))
    rows = [Rows(cache, [7, 8, 9], 3) for cache in stacked]
    together = path.batch(rows)
    assert forwards == [16, 4]
    for cache, got, r in zip(alone, together, rows):
        assert torch.equal(path(cache, [7, 8, 9], 3), got) and r.targets == got.argmax(-1).tolist()


def test_the_pool_doubles_when_sessions_outnumber_its_slots_and_keeps_their_caches():
    from codespec.forward.graphs import FIRST_SLOTS

    _, path = graph_path()
    first = path.new_cache()
    path(first, list(range(1, 30)), 1)
    before = path(first, [30, 31], 2)
    first.crop(29)
    others = [path.new_cache() for _ in range(FIRST_SLOTS + 1)]  # past the first slots: the pool doubles
    assert path.pool.slots == 2 * FIRST_SLOTS + 1 and len({c.slot for c in [first, *others]}) == FIRST_SLOTS + 2
    assert torch.equal(path(first, [30, 31], 2), before)


def test_a_tick_of_the_graph_safe_forward_verifies_drafts_up_to_the_width_and_costs_its_bucket():
    """The adaptive budget per bucket: any draft up to the width is free (its rows run anyway), so every offered
    token is verified, none past the width."""
    from codespec.adaptive import Acceptance, Adaptive
    from codespec.adaptive import BucketCosts, measure_bucket_costs
    from codespec.decode import Propose, verify_lengths

    _, path = graph_path(dtype=torch.float32)
    costs = measure_bucket_costs(path, 384, repeats=2)
    assert isinstance(costs, BucketCosts) and costs.sizes == path.buckets and all(s > 0 for s in costs.seconds)
    assert costs.cost(1, 3) == costs.cost(4 * WIDTH, 4) == costs.learnt[2]  # 3 or 4 sessions: the 4-session bucket
    assert costs.cost(4 * WIDTH + 1, 4) == 2 * costs.learnt[2]  # rows past the width: another forward
    frozen = BucketCosts(path.buckets, (0.010, 0.011, 0.012, 0.014, 0.020), WIDTH, pinned=True)

    def proposal(offered: int, hits: float, misses: float) -> Propose:
        adaptive = Adaptive(frozen)
        adaptive.acceptance["prompt-lookup"] = Acceptance(hits=hits, misses=misses)
        return Propose(adaptive, "prompt-lookup", offered, 1, 100)

    proposals = [proposal(30, 20.0, 1.0), proposal(5, 1.0, 6.0), proposal(0, 3.0, 3.0)]
    assert proposals[1].alpha < 0.3
    assert verify_lengths(frozen, proposals, []) == [WIDTH - 1, 5, 0]


def test_a_scheduler_tick_of_several_sessions_is_one_forward_and_each_gets_its_own_text(monkeypatch):
    import threading

    from codespec.scheduler import Scheduler

    model, _ = graph_path(dtype=torch.float32)
    engine = Engine(model, tiny_tokenizer(), LOOKUP, eos_token_ids=frozenset({EOS}), forward="graphs")
    rng = np.random.default_rng(8)
    prompts = [random_prompt(rng, 30 + 7 * i, repetitive=True) for i in range(6)]
    params = SamplingParams(max_tokens=32)
    expected = [engine.generate(p, params).tokens for p in prompts]
    sizes = []
    step = engine.path.step
    monkeypatch.setattr(engine.path, "step", lambda *args: sizes.append(args[1]) or step(*args))
    scheduler = Scheduler(engine)
    try:
        gate, inside = threading.Event(), threading.Event()
        threading.Thread(target=scheduler.call, args=(lambda _: inside.set() or gate.wait(10),), daemon=True).start()
        inside.wait(10)  # the worker waits inside a call: every job starts in the same tick
        jobs = [scheduler.submit(p, params) for p in prompts]
        gate.set()
        assert [job.wait().tokens for job in jobs] == expected
    finally:
        scheduler.close()
    assert 8 in sizes and len(sizes) <= scheduler.ticks  # six sessions in the 8-session bucket; a forward a tick


def test_the_graph_ops_are_pytorchs_on_a_cpu_and_a_named_choice_is_checked(monkeypatch):
    from codespec.forward.graph_ops import TorchOps, choose_ops

    assert isinstance(choose_ops(torch.device("cpu")), TorchOps)
    assert isinstance(choose_ops(torch.device("cuda"), dtype=torch.float64), TorchOps)  # Triton's: 32 and 16 bits
    monkeypatch.setenv("CODESPEC_GRAPH_OPS", "torch")
    assert isinstance(choose_ops(torch.device("cuda")), TorchOps)
    with pytest.raises(CodespecError, match="torch or triton"):
        choose_ops(torch.device("cuda"), "cutlass")


def test_a_device_without_room_for_twice_the_pool_grows_it_by_one_slot(monkeypatch):
    from codespec.forward import graphs

    _, path = graph_path()
    caches = [path.new_cache() for _ in range(graphs.FIRST_SLOTS)]
    allocate = graphs.Pool._allocate

    def at_most_six_slots(self, shape):
        if shape[1] > 6:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return allocate(self, shape)

    monkeypatch.setattr(graphs.Pool, "_allocate", at_most_six_slots)
    caches.append(path.new_cache())
    assert path.pool.slots == 6 and not path.pool.free
    with pytest.raises(graphs.DeviceMemoryFull):
        path.new_cache()
    assert path.pool.slots == 6 and [c.slot for c in caches] == [1, 2, 3, 4, 5]


def test_a_session_reused_across_requests_beside_other_sessions_writes_what_it_writes_alone():
    """Lossless three ways on the stacked forward: a named session's second request (its cache cropped back to the
    shared prefix) in ticks shared with other sessions gives the text that request gives in a fresh engine alone."""
    from codespec.scheduler import Scheduler

    model, _ = graph_path(dtype=torch.float32)
    rng = np.random.default_rng(9)
    first = random_prompt(rng, 40, repetitive=True)
    second = first[:25] + random_prompt(rng, 20, repetitive=True)  # shares a prefix, then rewrites the rest
    others = [random_prompt(rng, 30 + 5 * i, repetitive=True) for i in range(3)]
    params = SamplingParams(max_tokens=24)
    alone = Engine(model, tiny_tokenizer(), LOOKUP, eos_token_ids=frozenset({EOS}), forward="graphs")
    expected = alone.generate(second, params).tokens
    engine = Engine(model, tiny_tokenizer(), LOOKUP, eos_token_ids=frozenset({EOS}), forward="graphs")
    scheduler = Scheduler(engine)
    try:
        scheduler.submit(first, params, session_id="editor").wait()
        jobs = [scheduler.submit(p, params) for p in others]
        again = scheduler.submit(second, params, session_id="editor")
        assert again.wait().tokens == expected
        assert [job.wait().tokens for job in jobs] == [alone.generate(p, params).tokens for p in others]
    finally:
        scheduler.close()
