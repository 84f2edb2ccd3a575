"""Adaptive speculation: measured costs x per-drafter acceptance pick the draft length, output unchanged."""

import json

import numpy as np
import pytest
import torch

from codespec.adaptive import (SIZES, DraftingCosts, Acceptance, Adaptive, CostModel, allocate, cached_costs, choose,
                               measure_costs, steady)
from codespec import adaptive
from codespec.config import SamplingParams, SpecConfig
from codespec.decode import generate_steps
from codespec.drafters import Chain
from codespec.drafters.none import NoDrafter
from codespec.forward import forward_path
from codespec.sampling import Sampler
from codespec.session import Session
from codespec.stats import GenerationStats
from tests.tiny import EOS, FixedContinuation


def fixed_costs(per_token: float) -> CostModel:
    """1 s for one token plus per_token s for each further token; frozen (no learning from real forwards)."""
    costs = CostModel(SIZES, tuple(1.0 + per_token * (n - 1) for n in SIZES))
    costs.LEARN = 0.0
    return costs


def test_costs_interpolate_extend_and_never_fall_with_more_tokens():
    costs = CostModel((1, 2, 4, 8), (1.0, 0.9, 1.2, 2.0))  # a noisy k=1 measurement, slower than k=2
    assert costs.cost(1) == pytest.approx(0.9)  # monotone: k=1 takes the cheaper larger size
    assert costs.cost(3) == pytest.approx(1.05)
    assert costs.cost(12) == pytest.approx(2.0 + 0.2 * 4)  # the last slope, extended
    assert costs.relative(8) == pytest.approx(2.0 / 0.9)


def test_observed_forwards_pull_every_size_past_one_row_by_the_same_factor():
    """What forwards over some rows teach (the cache's attention, the load) every larger size pays too: learnt per
    size, the sizes that ran looked dearer than those that had not, and a prediction followed to the end verified
    7-16 tokens a step instead of 16. The measured table's shape still decides between sizes."""
    costs = CostModel((1, 2, 4, 16), (1.0, 1.0, 2.0, 4.0))
    for _ in range(50):
        costs.observe(2, 3.0)
    assert costs.cost(2) == pytest.approx(3.0, rel=0.02) and costs.cost(4) == pytest.approx(6.0, rel=0.02)
    assert costs.cost(16) == pytest.approx(12.0, rel=0.02) and costs.cost(1) == 1.0
    before = costs.cost(4)
    costs.observe(500, 9.0)  # a prefill: past the table, ignored
    assert costs.cost(4) == before
    drafts = [(0.997, 15, None)]
    assert allocate(costs, drafts, 1, 1) == [15]  # every row of a right draft, whichever size taught the level


def test_a_forward_over_several_sequences_teaches_what_each_sequence_adds_not_the_row_table():
    """Ticks of 7 and 8 sessions' single rows (each over its own long cache) took 20 and 27 ms: folded into the
    row table, one more row (a draft token) would look as dear as one more session, and no draft would pay."""
    costs = CostModel((1, 8, 16), (0.008, 0.009, 0.015))
    for _ in range(100):
        costs.observe(8, 0.027, sequences=8)
        costs.observe(7, 0.020, sequences=7)
    assert costs.cost(8) == pytest.approx(0.009) and costs.cost(7) == pytest.approx(0.008 + 0.001 * 6 / 7)
    assert 0.0018 < costs.per_sequence < 0.0026  # each session past the first: (27 - 9) / 7 and (20 - 8.9) / 6 ms
    assert costs.cost(8, sequences=8) == pytest.approx(0.009 + 7 * costs.per_sequence)
    drafts = [(0.85, 4, None)] * 7
    assert sum(allocate(costs, drafts, 7, 7, sequences=7)) > 0  # drafts priced by the rows they add
    # the table a server had learnt by folding them in (measured at 8 clients: 7 rows 20.6 ms, 8 rows 26.7, ...)
    folded = CostModel((1, 7, 8, 9, 11, 15, 23), (0.008, 0.0206, 0.0267, 0.0284, 0.033, 0.0422, 0.0971))
    assert sum(allocate(folded, drafts, 7, 7)) == 0


def test_a_prompt_chunk_teaches_the_verify_costs_nothing(model):
    """Prompt chunks take a path of their own (bfloat16 weights, a forward apart); learnt from, one prefill raised
    every multi-row estimate by a third and n_cmpl's alternatives kept it for a whole request. A forward that holds
    a prompt chunk leaves the costs as they were; a verify forward over the same rows teaches them."""
    from codespec.decode import forward_batch
    from codespec.forward.rows import Rows

    path = forward_path(model)
    costs = CostModel((1, 2, 4, 8), (1e3, 2e3, 4e3, 8e3))  # (seconds no forward here takes: any observation moves it)
    cache = path.new_cache()
    forward_batch(path, [Rows(cache, [5, 6, 7, 8], 1, prompt=True)], costs)
    other = path.new_cache()
    forward_batch(path, [Rows(cache, [9, 10], 1, prompt=True), Rows(other, [4, 5], 2, generating=True)], costs)
    assert (costs.one, costs.ratio, costs.per_sequence) == (1e3, 1.0, 0.0)
    forward_batch(path, [Rows(cache, [11, 12, 13, 14], 4, generating=True)], costs)
    assert costs.ratio < 1.0


def measured_here() -> CostModel:
    """This CPU's q8 forward (2026-11-25): the table over 256 cached tokens, and what each cached key adds."""
    return CostModel(SIZES, (0.00374, 0.00423, 0.0054, 0.00842, 0.01526, 0.02872, 0.05471, 0.1111),
                     key_seconds=0.32e-6, row_key_seconds=0.70e-6, context=256)


def test_the_cached_keys_each_row_attends_are_priced():
    """At 8 clients each session's cache held ~1,400 tokens: one more row of a verify took ~1.8 ms where the table
    (256 cached tokens) says 0.8. Priced by the table, drafts accepted 70% of the time were verified although they
    made the tick slower; priced by their keys they are not, and the forwards observed teach the table its own
    cache length."""
    costs = measured_here()
    assert costs.cost(8, 8, keys=8 * 1400, row_keys=8 * 1400) == pytest.approx(0.0183, abs=0.001)  # measured 17.8
    assert costs.cost(16, 8, keys=8 * 1400, row_keys=16 * 1400) == pytest.approx(0.0316, abs=0.001)  # 32.0
    assert costs.cost(4, keys=256, row_keys=4 * 256) == pytest.approx(costs.cost(4))
    tick = dict(rows=8, generating=8, sequences=8, keys=8 * 1400, row_keys=8 * 1400)
    assert sum(allocate(costs, [(0.7, 8, 1400)] * 4, **tick)) == 0
    table = CostModel(SIZES, costs.seconds)  # the keys unpriced, what 8 rows of 8 sessions took learnt per sequence
    table.per_sequence = (0.0178 - 0.00842) / 7
    assert sum(allocate(table, [(0.7, 8, None)] * 4, 8, 8, sequences=8)) > 0
    assert sum(allocate(costs, [(0.95, 8, 1400)] * 4, **tick)) > 0
    assert choose(costs, 0.8, 16, 1, keys=4000) < choose(costs, 0.8, 16, 1, keys=256)
    for keys in (100, 256, 3000):  # forwards that take what the model says leave the table where it is
        for _ in range(20):
            costs.observe(4, costs.cost(4, keys=keys, row_keys=4 * keys), keys=keys, row_keys=4 * keys)
    assert costs.cost(4) == pytest.approx(0.0054)


def test_a_batch_with_drafts_is_never_slower_than_without_by_its_costs():
    """Whatever the caches and acceptance rates, the rows allocate() adds yield at least the tokens per second of the
    same batch without drafts, by the cost model's own prices (counted here apart from allocate's bookkeeping)."""
    rng = np.random.default_rng(5)
    costs = measured_here()
    for _ in range(300):
        sessions = int(rng.integers(1, 10))
        caches = rng.integers(10, 4000, sessions).tolist()
        proposals = [(float(rng.uniform(0, 1)), int(rng.integers(0, 17)), k) for k in caches]
        plain = dict(keys=sum(caches), row_keys=sum(caches))
        counts = allocate(costs, proposals, sessions, sessions, sequences=sessions, **plain)
        assert all(0 <= c <= p[1] for c, p in zip(counts, proposals))
        rows = sessions + sum(counts)
        with_drafts = costs.cost(rows, sessions, plain["keys"], plain["row_keys"] + sum(c * k for c, k in
                                                                                       zip(counts, caches)))
        expected = sessions + sum(sum(a ** j for j in range(1, c + 1)) for c, (a, _, _) in zip(counts, proposals))
        assert expected / with_drafts >= sessions / costs.cost(sessions, sessions, **plain) - 1e-12


def test_a_pinned_cost_table_is_used_as_it_is_and_a_bad_one_stops_the_start(engine, tmp_path, monkeypatch, capsys,
                                                                            tiny_dir):
    from codespec.forward.kernels import attention
    from codespec.cli import main
    from codespec.engine import Engine

    table = tmp_path / "costs.json"
    table.write_text(json.dumps(CostModel((1, 2, 4), (0.010, 0.011, 0.013)).to_dict()))
    monkeypatch.setenv("CODESPEC_COSTS", str(table))
    pinned = Engine(engine.model, engine.tokenizer, engine.spec, eos_token_ids=engine.eos_token_ids).costs
    assert pinned.cost(2) == pytest.approx(0.011)
    pinned.observe(2, 5.0)  # pinned: real forwards do not move it
    assert pinned.cost(2) == pytest.approx(0.011)

    table.write_text('{"tokens": [1, 2]}')
    attention.ready()  # compiled first: on a cold numba cache its one-time notice is not the error's line
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_dir), "x"]) == 1
    err = capsys.readouterr().err
    assert "CODESPEC_COSTS" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("alpha, per_token, expected", [
    (0.0, 0.1, 0),  # nothing is ever accepted: plain decoding
    (0.05, 0.1, 0),  # a 5% chance of one more token does not pay for 10% more time
    (0.95, 0.0, 16),  # free verification: verify everything offered
    (0.9, 0.1, 10),  # (1 - 0.9^(k+1)) / 0.1 / (1 + 0.1 k): 3.26 at k=6, 3.43 at k=10, 3.39 at k=12
])
def test_choose_maximises_expected_tokens_per_second(alpha, per_token, expected):
    assert choose(fixed_costs(per_token), alpha, available=16, pending=1) == expected


def test_choose_never_prefers_speculation_that_is_slower_than_plain():
    costs = fixed_costs(0.2)
    for alpha in np.linspace(0, 0.99, 34):
        k = choose(costs, alpha, available=32, pending=1)
        expected = sum(alpha ** i for i in range(k + 1))
        assert expected / costs.cost(1 + k) >= 1 / costs.cost(1)


def test_acceptance_counts_the_targets_own_token_against_the_first_unverified_draft_token():
    adaptive = Adaptive(fixed_costs(0.1))
    adaptive.observe("lookup", [5, 6, 7], verified=0, accepted=0, next_token=5)  # held back, would have hit
    adaptive.observe("lookup", [5, 6, 7], verified=1, accepted=1, next_token=9)  # second token would have missed
    evidence = adaptive.of("lookup")
    assert evidence.skipped == 1
    assert evidence.hits == pytest.approx(0.9 * 1 + 1) and evidence.misses == pytest.approx(1)
    adaptive.observe("lookup", [5, 6], verified=2, accepted=2, next_token=1)  # all verified and accepted
    assert evidence.misses == pytest.approx(0.9) and evidence.alpha > 0.5
    assert Acceptance().alpha == 0.5  # no evidence yet: an even prior


def run(model, prompt, drafter, adaptive, max_tokens=40):
    session = Session(forward_path(model), Chain([drafter]))
    stats = GenerationStats()
    steps = list(generate_steps(session, prompt, Sampler(SamplingParams()), 16, max_tokens,
                                model.config.max_position_embeddings, frozenset({EOS}), stats, adaptive))
    return [t for step in steps for t in step.tokens], stats, session.chain.stats[0]


def test_useless_drafts_stop_being_verified_and_output_is_unchanged(model):
    prompt = list(range(10, 30))
    plain, _, _ = run(model, prompt, NoDrafter(), None)
    wrong = FixedContinuation(len(prompt), [(t + 1) % 300 + 1 for t in plain])  # always the wrong token
    tokens, stats, drafter = run(model, prompt, wrong, Adaptive(fixed_costs(0.1)))
    assert tokens == plain
    assert drafter.skipped_drafts > 0.7 * stats.target_forwards and stats.accepted_tokens == 0


def test_good_drafts_are_verified_in_full_when_verification_is_cheap(model):
    prompt = list(range(10, 30))
    plain, _, _ = run(model, prompt, NoDrafter(), None)
    tokens, stats, drafter = run(model, prompt, FixedContinuation(len(prompt), plain), Adaptive(fixed_costs(0.01)))
    assert tokens == plain
    assert stats.target_forwards <= 6 and drafter.skipped_drafts == 0


def test_a_drafter_switched_off_comes_back_when_its_drafts_would_pay(model):
    """Wrong for the first 20 tokens, right afterwards: the held-back drafts keep being checked against the
    target's tokens, so verification resumes."""
    prompt = list(range(10, 30))
    plain, _, _ = run(model, prompt, NoDrafter(), None, max_tokens=80)
    mixed = [(t + 1) % 300 + 1 if i < 20 else t for i, t in enumerate(plain)]
    tokens, stats, drafter = run(model, prompt, FixedContinuation(len(prompt), mixed), Adaptive(fixed_costs(0.1)),
                                 max_tokens=80)
    assert tokens == plain
    assert drafter.skipped_drafts > 0 and stats.accepted_tokens > 40


def test_measured_costs_cover_every_size_and_the_cached_keys(model, tmp_path, monkeypatch):
    costs = measure_costs(forward_path(model), model.config.vocab_size, context=16, sizes=(1, 2, 4), repeats=1,
                          longer=200)
    assert costs.sizes == (1, 2, 4) and all(s > 0 for s in costs.seconds) and costs.context == 16
    assert costs.key_seconds >= 0 and costs.row_key_seconds >= 0
    assert costs.cost(4, keys=216, row_keys=4 * 216) >= costs.cost(4)


def fake_forward(monkeypatch, extra):
    """A fake forward on a fake clock (adaptive's `time`): n rows take n ms, plus extra(sizes so far, n) seconds;
    clock.sizes lists every forward's rows."""
    import types

    clock = types.SimpleNamespace(now=0.0, sizes=[])
    monkeypatch.setattr(adaptive, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))

    class Cache:
        length = 0

        def crop(self, length):
            self.length = length

    class Path:
        def new_cache(self):
            return Cache()

        def __call__(self, cache, tokens, n):
            clock.now += 1e-3 * len(tokens) + extra(clock.sizes, len(tokens))
            clock.sizes.append(len(tokens))
            cache.length += len(tokens)

    return Path(), clock


def test_measured_sizes_take_turns_so_a_burst_of_load_costs_one_round_not_one_size(monkeypatch):
    """A fake forward on a fake clock: n rows take n ms, except twenty calls in a row (another process's burst)
    that take 50 ms more. Timed back to back, one size would have had all its repeats in the burst."""
    path, clock = fake_forward(monkeypatch, lambda sizes, n: 0.05 if 4 <= len(sizes) < 24 else 0.0)
    costs = measure_costs(path, 100, context=8, sizes=(1, 2, 4), repeats=4, longer=0)
    assert costs.seconds == pytest.approx((1e-3, 2e-3, 4e-3))
    settled = 1 + adaptive.SETTLE  # (each a short forward: its timed one after SETTLE untimed ones)
    # after the context's forward and the warm-up round, every size, round by round, from the largest down
    assert clock.sizes[4 : 4 + 6 * settled] == ([4] * settled + [2] * settled + [1] * settled) * 2


def test_each_size_is_timed_as_it_runs_in_generation_not_right_after_a_longer_forward(monkeypatch):
    """A forward right after a longer one costs more for a while (on a 2-core Intel Xeon a one-token forward after a
    128-row one took 7 ms, three forwards later 4.5): the fake forward's first three forwards after a larger one
    take 5 ms more. Each size is timed settled, after SETTLE untimed forwards of its own size, from the largest
    down: the table is the steady n ms for n rows."""

    def after_a_longer_one(sizes, n):
        recent = sizes[-3:]
        return 0.005 if any(m > n for m in recent) else 0.0

    path, clock = fake_forward(monkeypatch, after_a_longer_one)
    costs = measure_costs(path, 100, context=8, sizes=(1, 2, 4, 8), repeats=3, longer=0)
    assert costs.seconds == pytest.approx((1e-3, 2e-3, 4e-3, 8e-3))


def test_a_budget_times_the_sizes_that_fit_it_and_prices_the_rest_as_dear_a_token(monkeypatch):
    """With a budget, the warm-up round stops before a size whose rounds would not fit it, fewer rounds run where
    `repeats` would not, and the sizes not timed cost as much a token as the largest one timed (a 1.7B model's whole
    table took 75 s). The fake forward takes n ms for n rows, the first forward of each size 10 ms more."""
    path, clock = fake_forward(monkeypatch, lambda sizes, n: 0.01 if n not in sizes else 0.0)
    monkeypatch.setattr(adaptive, "SETTLE_BELOW", 0.0)  # (no size settles: each forward of a round is timed)
    # warm-up: 1 row 11 ms, 2 rows 12 ms; 4 rows would make (23 + 24) x 3 > 100 ms: not timed
    costs = measure_costs(path, 100, context=8, sizes=(1, 2, 4, 8), repeats=6, longer=0, budget=0.1)
    assert costs.seconds == pytest.approx((1e-3, 2e-3, 4e-3, 8e-3))
    assert clock.sizes[1:] == [1, 2] + [2, 1] * 3  # 100 ms / 23 ms: 3 rounds after the warm-up (largest first)
    clock.sizes.clear()
    whole = measure_costs(path, 100, context=8, sizes=(1, 2, 4, 8), repeats=6, longer=0)  # no budget: all, 6 rounds
    assert whole.seconds == pytest.approx((1e-3, 2e-3, 4e-3, 8e-3)) and clock.sizes[1:] == [1, 2, 4, 8] + [8, 4, 2, 1] * 6


def test_a_budget_counts_the_settling_forwards(monkeypatch):
    """Short sizes run SETTLE untimed forwards before each timed one; a budget counts them: 1 and 2 rows (11 and
    12 ms in the warm-up) cost (1 + SETTLE) x 23 ms a round, more than 100 ms, so the LEAST rounds run."""
    path, clock = fake_forward(monkeypatch, lambda sizes, n: 0.01 if n not in sizes else 0.0)
    costs = measure_costs(path, 100, context=8, sizes=(1, 2, 4, 8), repeats=6, longer=0, budget=0.1)
    assert costs.seconds == pytest.approx((1e-3, 2e-3, 4e-3, 8e-3))
    settled = 1 + adaptive.SETTLE
    assert clock.sizes[1:] == [1, 2] + ([2] * settled + [1] * settled) * adaptive.LEAST


def test_a_stretched_cache_holds_copies_of_its_positions_and_a_forward_runs_on_it(model):
    """StaticCache.stretch: as many keys as a longer cache, without computing them (measure_costs' caches)."""
    path = forward_path(model)
    cache = path.new_cache()
    path(cache, [5, 6, 7], 1)
    wanted = cache.capacity + 5  # (past its capacity: it grows)
    cache.stretch(wanted)
    assert cache.length == wanted <= cache.capacity
    for held in (cache.keys, cache.values):
        for start in range(0, wanted, 3):
            count = min(3, wanted - start)
            assert torch.equal(held[:, :, start : start + count], held[:, :, :count])
    assert torch.isfinite(path(cache, [8, 9], 2)).all() and cache.length == wanted + 2


def test_engine_measures_costs_once_and_adaptive_output_matches_plain(engine):
    prompt = list(range(10, 40)) * 2
    adaptive = engine.generate(prompt, SamplingParams(max_tokens=30), spec=SpecConfig(spec=("prompt-lookup",)))
    fixed = engine.generate(prompt, SamplingParams(max_tokens=30),
                            spec=SpecConfig(spec=("prompt-lookup",), adaptive=False))
    plain = engine.generate(prompt, SamplingParams(max_tokens=30), spec=SpecConfig(spec=("none",)))
    assert adaptive.tokens == fixed.tokens == plain.tokens
    assert engine.costs is engine.costs


def test_a_reference_the_caller_vouches_for_is_drafted_in_full_from_its_first_right_draft(model):
    """Adaptive.expect: a drafter whose reference the caller vouches for (a prediction, a rewrite's selection) has its
    first draft verified as any drafter's, and from its first hit on as if 30 tokens had been accepted: full drafts
    from the second step, where the default prior climbs 2, 8, 15, 16. A wrong reference loses the vouch at its
    first miss: the same draft lengths as without it. The text is plain's either way."""
    prompt = list(range(10, 30))
    plain, _, _ = run(model, prompt, NoDrafter(), None, max_tokens=60)

    def drafted(continuation, vouched):
        adaptive = Adaptive(fixed_costs(0.1))
        if vouched:
            adaptive.expect(FixedContinuation.name)
        session = Session(forward_path(model), Chain([FixedContinuation(len(prompt), continuation)]))
        steps = list(generate_steps(session, prompt, Sampler(SamplingParams()), 16, 37,
                                    model.config.max_position_embeddings, frozenset({EOS}), GenerationStats(),
                                    adaptive))
        assert [t for step in steps for t in step.tokens] == plain[:37]
        return [step.drafted for step in steps]

    right, unvouched = drafted(plain, True), drafted(plain, False)
    assert right == [2, 16, 16] and unvouched[1] < 16 and len(unvouched) == 4  # 37 tokens: 3 + 17 + 17
    wrong = [(t + 1) % 300 + 1 for t in plain]
    assert drafted(wrong, True) == drafted(wrong, False)
    evidence = Acceptance(vouched=Adaptive.EXPECTED_HITS)
    evidence.observe(0, True)  # a miss: what was vouched for goes
    assert evidence.alpha == Acceptance(misses=1).alpha



def test_a_followed_reference_drafts_past_draft_max_and_the_text_stays_plain_s(model):
    """Chain.reach (prediction_draft_max): the reference's drafter drafts up to 40 tokens a step where draft_max is
    16, bounded by what the step has room for; the text is plain decoding's."""
    class Following(FixedContinuation):
        follows_reference = True

    prompt = list(range(10, 30))
    plain, _, _ = run(model, prompt, NoDrafter(), None, max_tokens=60)
    adaptive = Adaptive(fixed_costs(0.01))  # (a CPU: 64 rows cost ~3x 16's)
    adaptive.expect(Following.name)
    chain = Chain([Following(len(prompt), plain)])
    chain.set_reference(plain, reach=40)
    session = Session(forward_path(model), chain)
    steps = list(generate_steps(session, prompt, Sampler(SamplingParams()), 16, 60,
                                model.config.max_position_embeddings, frozenset({EOS}), GenerationStats(), adaptive))
    assert [t for step in steps for t in step.tokens] == plain[:60]
    drafted = [step.drafted for step in steps]
    assert drafted[1] == 40 and len(drafted) == 3 and sum(drafted) + 3 == 60  # the last step drafts what is left

def test_a_generation_with_a_reference_vouches_for_it(engine):
    prompt = list(range(10, 40))
    params = SamplingParams(max_tokens=24)
    plain = engine.generate(prompt, params, spec=SpecConfig(spec=("none",)))
    spec = SpecConfig(spec=("edit-align",))
    vouched = engine.generate(prompt, params, spec=spec, reference=plain.tokens, session_id="vouched")
    assert vouched.tokens == plain.tokens
    assert engine.session("vouched", spec).adaptive.of("edit-align").vouched == Adaptive.EXPECTED_HITS


def test_adaptive_flag_and_config_key(tmp_path):
    from argparse import Namespace

    from codespec.cli.options import build_parser, settings_from_args
    from codespec.errors import CodespecError

    _, spec, _ = settings_from_args(build_parser().parse_args(["generate", "--no-adaptive", "x"]))
    assert spec.adaptive is False
    config = tmp_path / "c.toml"
    config.write_text("[spec]\nadaptive = false\n")
    assert settings_from_args(Namespace(config=str(config)))[1].adaptive is False
    config.write_text("[spec]\nadaptive = 1\n")
    with pytest.raises(CodespecError, match="wrong type"):
        settings_from_args(Namespace(config=str(config)))


def test_seeded_sampling_repeats_exactly_whatever_the_timing(engine):
    """Draft lengths chosen from timings would change how much randomness each step draws."""
    prompt = list(range(10, 40)) * 2
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=11)
    engine.costs.LEARN = 1.0  # every forward rewrites its cost estimate: timings vary run to run
    first = engine.generate(prompt, params, spec=SpecConfig(spec=("prompt-lookup",)))
    second = engine.generate(prompt, params, spec=SpecConfig(spec=("prompt-lookup",)))
    assert first.tokens == second.tokens


def test_drafting_cost_shortens_a_model_drafters_draft_and_can_switch_it_off():
    costs = fixed_costs(0.05)
    assert choose(costs, 0.8, 16, 1) > choose(costs, 0.8, 16, 1, draft_cost=0.3) > 0
    assert choose(costs, 0.3, 16, 1, draft_cost=0.5) == 0

    adaptive = Adaptive(costs)
    limit = adaptive.draft_limit(pending=1)
    assert limit("draft", 16) == 2  # not timed yet: a two-token draft measures what one more token costs
    adaptive.observe_draft("prompt-lookup", 16, 10.0)  # n-gram drafters are never capped
    assert limit("prompt-lookup", 16) == 16
    adaptive.observe_draft("draft", 4, 4 * 0.004)  # cheap enough to probe at the short interval
    for _ in range(20):
        adaptive.of("draft").observe(0, missed=True)
    lengths = [limit("draft", 16) for _ in range(1000)]
    # off, but probing now and then, each miss doubling the wait: after 16, 32, 64, 128 and then every 256 steps
    probes = [index + 1 for index, length in enumerate(lengths) if length == 1]
    assert set(lengths) == {0, 1} and probes == [16, 48, 112, 240, 496, 752]
    adaptive.observe("draft", [3], verified=1, accepted=1, next_token=4)  # a probe that hits
    assert adaptive.probe_wait == {}  # the short interval again


def test_probing_a_switched_off_draft_model_costs_at_most_one_percent_and_new_sessions_start_from_the_engines_evidence():
    """A probe first syncs the draft model's cache with the history it did not read while it was off: that
    catch-up is paid once per probe, so probes come rarely enough that they cost at most PROBE_SHARE of the time."""
    costs, shared = fixed_costs(0.05), DraftingCosts()
    adaptive = Adaptive(costs, shared)
    adaptive.observe_draft("draft", 2, 0.004, catch_up_seconds=3.996)  # a probe: 4 s in all, 4 forwards' time
    for _ in range(20):
        adaptive.observe("draft", [3], verified=0, accepted=0, next_token=4)  # held back, and wrong
    limit = adaptive.draft_limit(pending=1)
    lengths = [limit("draft", 16) for _ in range(1000)]
    probes = [index + 1 for index, length in enumerate(lengths) if length == 1]
    assert probes == [400, 800]  # 4 s of probing per 400 steps of 1 s: 1%
    assert sum(lengths) * 4.0 <= Adaptive.PROBE_SHARE * 1000 * 1.0

    fresh = Adaptive(costs, shared)  # another session of the same engine: off from its first step
    assert fresh.of("draft").alpha < 0.1 and fresh.draft_limit(pending=1)("draft", 16) == 0
    assert Adaptive(costs).draft_limit(pending=1)("draft", 16) == 2  # another engine knows nothing yet


def test_a_held_back_draft_model_drafts_again_only_through_a_probe_and_a_catch_up_is_not_a_tokens_cost():
    """Drafting after a held-back step first feeds the draft model every token it missed. choose() does not see
    that cost, so once held back a model drafter waits for a probe; a probe that hits lets choose() decide again."""
    costs = fixed_costs(0.05)
    adaptive = Adaptive(costs)
    adaptive.observe_draft("draft", 1, 2.0, catch_up_seconds=1.9)  # one token, all of it the catch-up's forward
    assert "draft" not in adaptive.shared.seconds and adaptive.shared.catch_up == {"draft": 1.9}
    adaptive.observe_draft("draft", 3, 0.2)  # in step: three forwards for three tokens
    assert adaptive.shared.seconds == {"draft": pytest.approx(0.2 / 3)}
    limit = adaptive.draft_limit(pending=1)
    adaptive.of("draft").hits, adaptive.of("draft").misses = 0.0, 10.0  # no use: held back
    assert limit("draft", 16) == 0 and "draft" in adaptive.held_back
    adaptive.of("draft").hits, adaptive.of("draft").misses = 50.0, 0.0  # it would pay now, if it were in step
    lengths = [limit("draft", 16) for _ in range(400)]
    probe = next(index for index, length in enumerate(lengths) if length)
    assert probe + 2 == adaptive.probe_interval("draft", 1, Adaptive.PROBE) == 197  # 1.97 s a probe: 1% of 197 s
    assert lengths[probe] == 1  # the probe
    assert lengths[probe + 1] > 1  # in step after the probe: choose() decides, and drafting pays


def test_chain_skips_a_drafter_its_limit_rules_out():
    class Fixed(NoDrafter):
        def __init__(self, name, tokens):
            self.name, self.tokens = name, tokens

        def draft(self, history, max_tokens):
            from codespec.drafters import Draft
            return Draft(self.tokens[:max_tokens])

    chain = Chain([Fixed("draft", [1, 2, 3]), Fixed("prompt-lookup", [4, 5, 6])])
    history = np.zeros(4, dtype=np.int64)
    assert chain.draft(history, 8, lambda name, n: 0 if name == "draft" else n).tokens == [4, 5, 6]
    assert chain.last == "prompt-lookup"
    assert chain.draft(history, 8, lambda name, n: 2).tokens == [1, 2]


def test_a_drafter_that_never_matches_is_switched_off_within_a_few_steps(model):
    """With this machine's shape of costs (one more token verified: ~10% more time), a drafter whose every
    token is wrong has its drafts verified at most for the first few steps, then never again: the held-back
    drafts are still checked against the target's own token for free, and they keep missing (after a few calls the
    drafter itself is held back, and its probes' drafts teach alpha the same way)."""
    prompt = list(range(10, 30))
    plain, _, _ = run(model, prompt, NoDrafter(), None, max_tokens=120)
    wrong = FixedContinuation(len(prompt), [(t + 1) % 300 + 1 for t in plain])
    adaptive = Adaptive(fixed_costs(0.1))
    session = Session(forward_path(model), Chain([wrong]))
    steps = list(generate_steps(session, prompt, Sampler(SamplingParams()), 16, 120, 512, frozenset({EOS}),
                                GenerationStats(), adaptive))
    verified_at = [index for index, step in enumerate(steps) if step.drafted > 0]
    assert [t for step in steps for t in step.tokens] == plain
    assert len(steps) == 120 and verified_at and max(verified_at) < 12, verified_at
    assert sum(step.drafted for step in steps) <= 12  # the whole cost of finding out: about a dozen tokens


@pytest.mark.parametrize("seed", range(4))
def test_greedy_output_does_not_depend_on_the_draft_lengths_timing_picks(engine, monkeypatch, seed):
    """Adaptive lengths follow the machine's timing, which varies run to run; greedy output must not. Here the
    lengths are random at every step (as the most erratic timing could make them) and compared with plain."""
    import codespec.decode

    rng = np.random.default_rng(seed)
    prompt = list(rng.integers(1, 300, 20)) * 3
    plain = engine.generate(prompt, SamplingParams(max_tokens=60), spec=SpecConfig(spec=("none",)))
    lengths = []

    def erratic(costs, proposals, rows, generating, **batch):
        lengths.extend(int(rng.integers(0, available + 1)) for _, available, _ in proposals)
        return lengths[-len(proposals):]

    monkeypatch.setattr(codespec.decode, "allocate", erratic)
    # every drafter asked every step: whether a drafter's calls pay follows the machine's timing too, and holding
    # one back would leave fewer drafts to verify at random lengths
    monkeypatch.setattr(Adaptive, "pays_to_call", lambda self, drafter: True)
    for chain in (("prompt-lookup",), ("ngram-mod", "prompt-lookup"), ("ngram-map-k",)):
        result = engine.generate(prompt, SamplingParams(max_tokens=60), spec=SpecConfig(spec=chain, ngram_min=1))
        assert result.tokens == plain.tokens, chain
    assert len(set(lengths)) > 3  # many different lengths were really verified


@pytest.mark.parametrize("seed", range(3))
def test_seeded_sampling_writes_plain_samplings_text_whatever_the_draft_lengths(engine, monkeypatch, seed):
    """An n-gram draft is checked by sampling each position in turn, one draw per output token: a seed gives plain
    sampling's text token for token however many draft tokens each step verifies, so seeded sampling keeps the
    adaptive lengths (here random at every step, as the most erratic timing could make them)."""
    import codespec.decode

    rng = np.random.default_rng(seed)
    prompt = list(rng.integers(1, 300, 20)) * 3
    params = SamplingParams(max_tokens=60, temperature=0.7, seed=seed)
    plain = engine.generate(prompt, params, spec=SpecConfig(spec=("none",)))
    lengths = []

    def erratic(costs, proposals, rows, generating, **batch):
        lengths.extend(int(rng.integers(0, available + 1)) for _, available, _ in proposals)
        return lengths[-len(proposals):]

    monkeypatch.setattr(codespec.decode, "allocate", erratic)
    # every drafter asked every step: whether a drafter's calls pay follows the machine's timing too, and holding
    # one back would leave fewer drafts to verify at random lengths
    monkeypatch.setattr(Adaptive, "pays_to_call", lambda self, drafter: True)
    for chain in (("prompt-lookup",), ("ngram-mod", "prompt-lookup")):
        result = engine.generate(prompt, params, spec=SpecConfig(spec=chain, ngram_min=1))
        assert result.tokens == plain.tokens, chain
    assert len(set(lengths)) > 3  # adaptive lengths chose them: many different lengths were really verified


def test_the_hosts_own_work_per_step_is_priced_so_a_draft_that_saves_a_step_saves_it_too():
    """One more row costs 20% of a forward: at alpha 0.15 verifying does not pay for the forward alone (1.15
    tokens for 1.2x the time), but with a step's host work as large as its forward it does (1.15 for 2.2 against 1
    for 2)."""
    costs = fixed_costs(0.2)
    assert choose(costs, 0.15, 4, 1) == 0
    assert choose(costs, 0.15, 4, 1, host=1.0) == 1
    assert allocate(costs, [(0.15, 4, None)], 1, 1, host=1.0) == [1]


def test_a_drafter_whose_calls_save_less_than_they_cost_is_held_back_and_probed_now_and_then():
    adaptive = Adaptive(fixed_costs(0.1))
    limit = adaptive.draft_limit(pending=1)
    assert limit("prompt-lookup", 16) == 16  # nothing measured yet: it drafts
    for _ in range(30):  # 20 ms a call (2% of a 1 s step), no draft
        adaptive.observe_calls([("prompt-lookup", 0.02)], None, 0.0)
    calls = [index + 1 for index in range(40) if limit("prompt-lookup", 16)]
    assert calls == list(range(4, 41, 4))  # a probe every 4 steps: 20 ms per 4 s of steps
    adaptive.observe_calls([("prompt-lookup", 0.02)], "prompt-lookup", 1.0)  # a probe whose draft saved a step
    assert all(limit("prompt-lookup", 16) == 16 for _ in range(10))  # drafting every step again
    assert adaptive.shared.calls["prompt-lookup"] == pytest.approx(0.02)  # the engine's, for every session
    cheap = Adaptive(fixed_costs(0.1))
    for _ in range(30):  # 50 us a call (0.005% of a step) saving nothing: not worth holding back
        cheap.observe_calls([("prompt-lookup", 50e-6)], None, 0.0)
    assert all(cheap.draft_limit(pending=1)("prompt-lookup", 16) == 16 for _ in range(10))


def test_a_drafters_first_slow_call_does_not_hold_it_back_for_dozens_of_steps():
    """A drafter's very first call took 3 ms (its first use in a process), the next ones 8 us: the estimate starts
    again from the fast call instead of fading from 3 ms by a tenth a step (40 steps later still 45 us, held back
    beside a 0.27 ms forward)."""
    shared = DraftingCosts()
    shared.observe_call("prompt-lookup", 3e-3)
    shared.observe_call("prompt-lookup", 8e-6)
    assert shared.calls["prompt-lookup"] == pytest.approx(8e-6)
    shared.observe_call("prompt-lookup", 10e-6)  # the usual noise moves it a tenth of the way
    assert shared.calls["prompt-lookup"] == pytest.approx(8.2e-6)
    shared.observe_call("prompt-lookup", 1.0)  # a pause: counted as OUTLIER times the estimate at most
    assert shared.calls["prompt-lookup"] == pytest.approx(8.2e-6 + 0.1 * (4 - 1) * 8.2e-6)


def test_a_chain_holds_back_only_the_drafter_that_does_not_pay():
    adaptive = Adaptive(fixed_costs(0.1))
    for _ in range(30):  # ngram-mod drafts nothing here (at 2% of a step a call); prompt-lookup's save a token each
        adaptive.observe_calls([("ngram-mod", 0.02), ("prompt-lookup", 0.02)], "prompt-lookup", 1.0)
    limit = adaptive.draft_limit(pending=1)
    assert limit("ngram-mod", 16) == 0 and limit("prompt-lookup", 16) == 16
    assert adaptive.savings["ngram-mod"] < adaptive.shared.calls["ngram-mod"] < adaptive.savings["prompt-lookup"]


def test_a_drafter_that_never_matches_is_not_even_called_after_a_while_and_output_is_unchanged(model):
    """Every step prices its drafters' calls: a drafter whose drafts are always wrong costs its draft() time for
    nothing (here 10 ms a call, 1% of a 1 s step), so after a few steps it is called only as a probe, every
    CALL_PROBE steps."""
    import time

    class Slow(FixedContinuation):
        def draft(self, history, max_tokens):
            time.sleep(0.01)
            return super().draft(history, max_tokens)

    prompt = list(range(10, 30))
    plain, _, _ = run(model, prompt, NoDrafter(), None, max_tokens=120)
    wrong = Slow(len(prompt), [(t + 1) % 300 + 1 for t in plain])
    adaptive = Adaptive(fixed_costs(0.1))
    tokens, stats, drafter = run(model, prompt, wrong, adaptive, max_tokens=120)
    assert tokens == plain
    assert drafter.calls <= 6 + 120 // Adaptive.CALL_PROBE and drafter.skipped_drafts >= 90, drafter
    assert 0 < adaptive.shared.host < 0.1  # each step's host work, measured: well under a (1 s) forward


def test_a_burst_of_load_that_priced_a_size_high_is_forgotten_once_one_token_forwards_run_at_speed_again():
    """Forwards over 2 rows timed during a burst of load (10x) raised their estimate, and a size priced that high is
    never chosen again, so no forward of its own could bring it down: once one-token forwards (which every step
    runs) are back at their measured speed, the size's price is back at its measured one too."""
    costs = CostModel((1, 2, 4, 8), (0.004, 0.005, 0.0065, 0.009))
    for _ in range(20):  # the burst: 2 rows take 50 ms
        costs.observe(2, 0.05)
    assert costs.cost(2) > 0.006  # during the burst the price rose (by OUTLIER times at most, each forward)
    for _ in range(200):  # the burst is over: one-token forwards at their measured 4 ms
        costs.observe(1, 0.004)
    assert costs.cost(2) == pytest.approx(0.005, rel=0.01)
    assert costs.cost(4) == pytest.approx(0.0065, rel=0.01)
    for _ in range(200):  # the whole machine slower (another process on a core): every size scales with one row
        costs.observe(1, 0.008)
    assert costs.cost(2) == pytest.approx(0.010, rel=0.02) and costs.cost(8) == pytest.approx(0.018, rel=0.02)


QUIET = (4.68, 4.97, 5.70, 8.30, 14.43, 25.83, 49.15, 99.98)  # ms, the default model measured on a quiet host


@pytest.mark.parametrize("table, believed", [
    (QUIET, True),
    ((3.08, 3.29, 4.03, 5.80, 10.32, 17.69, 31.48, 63.0), True),  # docs/benchmarks/forward-costs-2026-11-26.json
    ((16.96, 15.93, 16.14, 18.35, 21.87, 29.12, 45.70, 80.0), True),  # bfloat16: flat, then rising
    ((487.3, 480.6, 290.7, 32.0, 37.3, 72.2, 144.2, 1919.6), False),  # tables kept on disk by runs beside others
    ((42.7, 12.9, 14.7, 83.5, 77.5, 218.3, 529.0, 870.8), False),
    ((16.8, 13.0, 14.3, 32.7, 67.3, 391.5, 721.4, 1174.9), False),
])
def test_a_table_measured_beside_other_work_is_not_believed(table, believed):
    assert steady(SIZES, tuple(ms / 1e3 for ms in table)) is believed


class ClockedPath:
    """A fake forward on a fake clock: n rows take QUIET's time, and one row `burst` seconds more in the first `busy`
    measurements (another process's load: a forward of one size slowed in every round of a measurement). A
    measurement begins with one forward over its whole context (its cache cannot stretch): they are counted."""

    def __init__(self, monkeypatch, busy=0, burst=0.48):
        import types

        self.now, self.measurements, self.busy, self.burst = 0.0, 0, busy, burst
        monkeypatch.setattr(adaptive, "time", types.SimpleNamespace(perf_counter=lambda: self.now))
        self.times = dict(zip(SIZES, (ms / 1e3 for ms in QUIET)))

    def new_cache(self):
        return types_cache()

    def __call__(self, cache, tokens, n):
        if cache.length == 0:
            self.measurements += 1
        self.now += self.times.get(len(tokens), 1e-3 * len(tokens))
        if len(tokens) == 1 and self.measurements <= self.busy:
            self.now += self.burst
        cache.length += len(tokens)


def types_cache():
    import types

    cache = types.SimpleNamespace(length=0)
    cache.crop = lambda length: setattr(cache, "length", length)
    return cache


def named_model(name="clocked"):
    import types

    return types.SimpleNamespace(config=types.SimpleNamespace(_name_or_path=name), device="cpu", dtype="float32")


def test_an_unsteady_measurement_is_measured_again_and_the_steady_one_kept(tmp_path, monkeypatch):
    """The first measurement's one-row forwards are slowed in every round (its fastest round too); the second
    measurement is quiet, and it is the one used and written."""
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path))
    path = ClockedPath(monkeypatch, busy=1)
    costs = cached_costs(path, named_model(), 100)
    assert path.measurements == 2 and steady(costs.sizes, costs.seconds)
    assert costs.seconds == pytest.approx(tuple(ms / 1e3 for ms in QUIET))
    (file,) = (tmp_path / "costs").glob("*.json")
    assert json.loads(file.read_text())["seconds"] == pytest.approx(list(costs.seconds))


def test_a_machine_busy_through_every_measurement_is_not_kept_and_a_kept_unsteady_table_is_measured_again(
        tmp_path, monkeypatch):
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path))
    busy = ClockedPath(monkeypatch, busy=10 ** 6)
    costs = cached_costs(busy, named_model(), 100)
    assert not steady(costs.sizes, costs.seconds) and busy.measurements == 3
    assert not (tmp_path / "costs").exists() or not list((tmp_path / "costs").glob("*.json"))  # not kept
    quiet = ClockedPath(monkeypatch)
    first = cached_costs(quiet, named_model(), 100)
    (file,) = (tmp_path / "costs").glob("*.json")
    data = json.loads(file.read_text())
    file.write_text(json.dumps({**data, "seconds": [0.487, 0.481, 0.291, 0.032, 0.037, 0.072, 0.144, 1.92]}))
    fresh = ClockedPath(monkeypatch)
    again = cached_costs(fresh, named_model(), 100)
    assert fresh.measurements == 1  # measured again, not read
    assert again.seconds == pytest.approx(first.seconds)
    assert json.loads(file.read_text())["seconds"] == pytest.approx(list(first.seconds))
