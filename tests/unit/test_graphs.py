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
    store = cache.store
    del cache
    gc.collect()
    again = path.new_cache()
    assert again.store is store and again.length == 0
    assert path.new_cache().store is not store


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
    """From now on the device holds `room` more caches: another one fails as a GPU's allocation would."""
    from codespec.forward import graphs

    engine.costs  # measured first, on a cache of its own
    engine.path.free.clear()
    made = []
    original = graphs.Store.__init__

    def store(self, *args):
        if len(made) >= room:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 MiB (simulated)")
        made.append(self)
        original(self, *args)

    monkeypatch.setattr(graphs.Store, "__init__", store)


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
    assert len(engine.path.free) == 2


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
