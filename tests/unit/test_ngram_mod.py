"""ngram-mod: one pool for every session, constant memory, and exact forgetting on history rewrites."""

from collections import Counter

import numpy as np
import pytest

from codespec.config import SamplingParams, SpecConfig
from codespec.drafters.ngram_mod import EMPTY, MULTIPLIER, NgramMod, NgramPool
from codespec.engine import Engine
from tests.conftest import random_prompt
from tests.tiny import EOS

NONE = SpecConfig(spec=("none",))


def window_hash(window) -> int:
    """llama.cpp's LCG hash of a window, from its definition: sum of token * A^(n - 1 - i), modulo 2^64."""
    n = len(window)
    return sum(int(token) * pow(MULTIPLIER, n - 1 - i, 1 << 64) for i, token in enumerate(window)) % (1 << 64)


POOLS = [(dict(mod_n=3, mod_pool_size=1 << 16), ("ngram-mod",)), (dict(mod_n=3, mod_pool_size=1 << 16),
         ("prompt-lookup", "ngram-mod")), (dict(mod_n=2, mod_pool_size=1 << 12), ("ngram-mod", "prompt-lookup"))]


@pytest.mark.parametrize("seed", range(10))
def test_greedy_identity_with_ngram_mod_and_chains(model, tokenizer, seed):
    rng = np.random.default_rng(100 + seed)
    prompt = random_prompt(rng, int(rng.integers(20, 120)), repetitive=True)
    params = SamplingParams(max_tokens=48)
    for pool, chain in POOLS:
        engine = Engine(model, tokenizer, SpecConfig(**pool), eos_token_ids=frozenset({EOS}))
        plain = engine.generate(prompt, params, spec=NONE)
        spec = SpecConfig(spec=chain, draft_max=16)
        assert engine.generate(prompt, params, spec=spec, session_id=f"s{seed}").tokens == plain.tokens
        assert engine.generate(prompt, params, spec=spec).tokens == plain.tokens  # pool warm from the line above


def test_every_session_of_an_engine_uses_its_one_pool_and_draft_max_keeps_the_chain(model, tokenizer):
    """A request that names other pool settings still drafts from (and teaches) the engine's pool, so every
    frontend of a process shares one; a request that changes only draft_max keeps its session's drafters and
    what they taught the pool."""
    engine = Engine(model, tokenizer, SpecConfig(mod_n=3, mod_pool_size=1 << 16), eos_token_ids=frozenset({EOS}))
    prompt = random_prompt(np.random.default_rng(9), 60, repetitive=True)
    params = SamplingParams(max_tokens=24)
    engine.generate(prompt, params, session_id="http", spec=SpecConfig(spec=("ngram-mod",), mod_n=16))
    engine.generate(prompt, params, session_id="lsp", spec=SpecConfig(spec=("ngram-mod",)))
    pools = {id(engine.sessions[name].chain.drafters[0].pool) for name in ("http", "lsp")}
    assert pools == {id(engine.shared.pool)} and engine.shared.pool.n == 3
    chain = engine.sessions["http"].chain
    occupied = engine.shared.pool.occupied
    engine.generate(prompt, params, session_id="http", spec=SpecConfig(spec=("ngram-mod",), draft_max=4))
    assert engine.sessions["http"].chain is chain  # not rebuilt: nothing taken back from the pool
    assert engine.shared.pool.occupied >= occupied
    engine.generate(prompt, params, session_id="http", spec=SpecConfig(spec=("prompt-lookup",)))
    assert engine.sessions["http"].chain is not chain  # other drafters: a new chain


def test_one_pool_is_shared_and_drafts_across_sessions(model, tokenizer):
    """Session B's acceptance on text session A saw is higher than with an empty pool."""
    rng = np.random.default_rng(5)
    prompt = random_prompt(rng, 60, repetitive=False)  # no repetition: prompt lookup alone has little to copy
    params = SamplingParams(max_tokens=64)
    spec = SpecConfig(spec=("ngram-mod",), mod_n=3, mod_pool_size=1 << 16, mod_reset_low_rounds=10**6)
    engine = Engine(model, tokenizer, spec, eos_token_ids=frozenset({EOS}))
    cold = engine.generate(prompt, params, session_id="B-cold", spec=spec)
    engine.shared.pool.reset()  # an empty pool again
    engine.generate(prompt, params, session_id="A", spec=spec)
    warm = engine.generate(prompt, params, session_id="B", spec=spec)
    assert engine.sessions["A"].chain.drafters[0].pool is engine.sessions["B"].chain.drafters[0].pool
    assert warm.tokens == cold.tokens
    assert warm.stats.accepted_tokens > cold.stats.accepted_tokens + 20
    assert warm.stats.tokens_per_forward > 2 * cold.stats.tokens_per_forward


def test_pool_memory_is_constant_after_millions_of_tokens():
    pool = NgramPool(size=1 << 16, n=8)
    before = pool.nbytes
    sessions = [NgramMod(pool) for _ in range(4)]
    rng = np.random.default_rng(0)
    for round_ in range(40):  # 40 x 4 sessions x 12.5k = 2M tokens
        for session in sessions:
            history = rng.integers(0, 49152, 12_500)
            session.truncate(0)
            session.begin(history, None)
    assert pool.nbytes == before == (1 << 16) * 8
    assert pool.resets > 0 and pool.occupancy <= pool.reset_occupancy


def test_truncation_forgets_only_the_removed_tokens():
    pool = NgramPool(size=1 << 20, n=4)
    a, b, c = NgramMod(pool), NgramMod(pool), NgramMod(pool)
    shared_start = np.arange(1000, 1010)
    a_text = np.concatenate([shared_start, np.arange(2000, 2040)])
    c_text = np.arange(3000, 3040)
    a.begin(a_text, None)
    c.begin(c_text, None)
    probe = a_text[:20]
    assert b.draft(probe, 8).tokens == a_text[20:28].tolist()  # B drafts what A saw
    a.truncate(15)  # A's history was rewritten after position 15 (an edit above the cursor)
    assert b.draft(probe, 8) is None  # the removed continuation is no longer drafted
    assert b.draft(a_text[:14], 1).tokens == [a_text[14]]  # what A still holds stays
    assert b.draft(c_text[:10], 8).tokens == c_text[10:18].tolist()  # another session's contribution stays


def test_a_continuation_two_sessions_taught_survives_one_forgetting():
    pool = NgramPool(size=1 << 20, n=4)
    a, b = NgramMod(pool), NgramMod(pool)
    text = np.arange(500, 540)
    a.begin(text, None)
    b.begin(text, None)
    a.truncate(0)
    assert pool.draft(text[:10], 5) == text[10:15].tolist()
    b.truncate(0)
    assert pool.draft(text[:10], 5) == []
    assert pool.occupied == 0 and not pool.counts.any()


def test_random_interleavings_keep_the_pool_consistent():
    """Sessions extend and cut their histories at random. Histories are windows of one sequence whose
    n-grams are unique, so every key has one next token and the pool must equal an exact recount."""
    n = 3
    universe = np.random.default_rng(1).permutation(20_000)  # all n-grams distinct
    pool = NgramPool(size=1 << 22, n=n, reset_occupancy=1.0)
    rng = np.random.default_rng(2)
    sessions = [(NgramMod(pool), int(rng.integers(0, 15_000))) for _ in range(6)]
    lengths = [0] * len(sessions)
    for _ in range(400):
        index = int(rng.integers(len(sessions)))
        drafter, offset = sessions[index]
        if rng.random() < 0.6:
            lengths[index] = min(lengths[index] + int(rng.integers(1, 40)), 4000)
            history = universe[offset : offset + lengths[index]]
            drafter.draft(history, 1)  # (it learns what its history added when asked to draft)
        else:
            lengths[index] = int(rng.integers(0, lengths[index] + 1))
            drafter.truncate(lengths[index])
        expected = Counter()
        for (_, start), length in zip(sessions, lengths):
            history = universe[start : start + length]
            if length > n:
                slots = [window_hash(history[p - n : p]) % pool.size for p in range(n, length)]
                expected.update(zip(slots, history[n:].tolist()))
        live = np.flatnonzero(pool.values != EMPTY)
        assert {(int(s), int(pool.values[s])): int(pool.counts[s]) for s in live} == dict(expected)
        assert pool.occupied == len(live) and not pool.counts[pool.values == EMPTY].any()


def test_reset_by_occupancy_and_by_poor_acceptance():
    pool = NgramPool(size=1 << 12, n=2, reset_occupancy=0.25, reset_low_rounds=3)
    drafter = NgramMod(pool)
    drafter.begin(np.arange(2000), None)  # 2000 slots > 25% of 4096
    assert pool.resets == 1 and pool.occupied == 0
    drafter.truncate(0)  # its log died with the reset: nothing to undo, nothing breaks
    drafter.begin(np.arange(100), None)
    assert pool.occupied > 0
    for accepted in (1, 0, 2):
        drafter.accept(np.arange(100), 10, accepted)
    assert pool.resets == 2 and pool.occupied == 0


def test_draft_is_well_under_a_millisecond():
    import time

    pool = NgramPool()  # the default 4M-slot pool, n = 24
    history = np.tile(np.random.default_rng(3).integers(0, 49152, 2048), 2)
    NgramMod(pool).begin(history, None)
    drafter = NgramMod(pool)
    timings = []
    for end in range(2100, 2200):
        started = time.perf_counter()
        draft = drafter.draft(history[:end], 64)
        timings.append(time.perf_counter() - started)
        assert draft.tokens == history[end : end + 64].tolist()
    print(f"ngram-mod draft of 64 tokens: median {np.median(timings) * 1e6:.0f} us")
    assert np.median(timings) < 1e-3
