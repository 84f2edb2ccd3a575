"""`codespec bench` end to end on the tiny model: every class runs, outputs match plain, files are written."""

import json

import pytest

from codespec.bench import runner
from codespec.bench.workloads import all_workloads
from codespec.config import SpecConfig
from codespec.engine import Engine
from tests.tiny import EOS, tiny_model


def test_quick_bench_on_the_tiny_model(tokenizer, tmp_path):
    engine = Engine(tiny_model(context=8192), tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}))
    workloads = all_workloads(1)
    assert {w.kind for w in workloads} == {"edit", "completion", "multi-turn", "free-form", "prose"}
    configs = runner.build_configs(quick=False, draft_max=8, default_spec=SpecConfig(draft_max=8), layers=2)
    assert {runner.DEFAULT_CHAIN, runner.FIXED_CHAIN, runner.DRAFT_QUARTER} <= {c.name for c in configs}
    rows = runner.run_bench(engine, workloads, configs, repeats=2, max_tokens=8, turns=3)
    assert not engine.sessions  # every run's session (and its KV cache) is dropped
    data = runner.report(rows, {"device": engine.model.device, "dtype": "float64", "max_tokens": 8, "repeats": 2})
    assert all(r["identical_to_plain"] for r in data["results"]), [r for r in data["results"] if not r["identical_to_plain"]]
    assert len(data["results"]) == len(workloads) * len(configs)
    multi = [r for r in data["results"] if r["kind"] == "multi-turn" and r["config"] == runner.PLAIN][0]
    assert multi["tokens"] > 8  # three turns' worth of tokens
    assert {s["kind"] for s in data["by_class"]} == {"edit", "completion", "multi-turn", "free-form", "prose"}
    (tmp_path / "bench.json").write_text(json.dumps(data))
    runner.plot(data, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "codespec default" in runner.format_table(data)
    row = data["results"][0]
    assert row["decode_tokens_per_second"] > 0 and row["decode_speedup_vs_plain"] > 0
    assert all(s["identical_share"] == 1 and s["worst_paired_speedup_vs_plain"] > 0 for s in data["by_class"])
    assert isinstance(data["slower_than_plain"], list) and "slower than 0.97x of plain" in runner.format_table(data)


def test_forward_costs_table_on_the_tiny_model():
    import torch

    from codespec.bench.forward_costs import SIZES, format_forward_costs, forward_costs

    model = tiny_model(dtype=torch.bfloat16).float()  # bfloat16 values in float32, as the default model's
    data = forward_costs(model, model.config.vocab_size)
    assert [row["path"] for row in data["rows"]] == ["lean float32", "lean, PyTorch only", "transformers float32",
                                                     "lean bfloat16"]
    assert all(sorted(row["ms"]) == list(SIZES) and row["floor_ms"] > 0 for row in data["rows"])
    # the floor is the row's bytes at the measured read bandwidth, at any scale (the tiny model's is ~0.005 ms)
    assert all(abs(row["floor_ms"] / (row["read_mb"] / data["read_bandwidth_gb_s"]) - 1) < 0.02 for row in data["rows"])
    lean, wide, _, bf16 = data["rows"]
    assert abs(wide["read_mb"] - data["weight_mb_float32"]) < 0.1
    assert bf16["read_mb"] == pytest.approx(wide["read_mb"] / 2, rel=1e-3)
    assert lean["read_mb"] <= wide["read_mb"] / 2  # 16 bits of each projection weight, nothing else
    assert data["reads_16_bits_up_to"] == 16
    shares = data["profile"][0]["shares"]
    assert set(shares) == {"weight matmuls", "attention", "other kernels", "numba, python, gaps"}
    assert abs(sum(shares.values()) - 1) < 0.05
    assert "up to k=16 in numba" in format_forward_costs(data)
    assert set(data["prefill_tok_s"]) == {f"{p}, chunks of {c}" for p in ("float32", "bfloat16") for c in (700, 128)}
    assert all(rate > 0 for rate in data["prefill_tok_s"].values())
    assert "prefill of a 700-token prompt, tok/s (--prompt-precision): float32, chunks of 700" in format_forward_costs(data)


def test_the_never_slower_lane_pairs_runs_per_length_and_reports_spreads(tokenizer, monkeypatch):
    from codespec.bench import never_slower

    engine = Engine(tiny_model(context=8192), tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}))
    workloads = [w for w in all_workloads(1) if w.kind in ("edit", "prose")]
    configs = [c for c in runner.build_configs(quick=True, draft_max=8, default_spec=SpecConfig(draft_max=8))
               if c.name in (runner.PLAIN, runner.DEFAULT_CHAIN, "prompt-lookup")]
    data = never_slower.run_lane(engine, workloads, configs, lengths=(4, 100, 400), repeats=1, repeats_recheck=1)
    assert {(r["kind"], r["config"], r["max_tokens"]) for r in data["results"]} == {
        (kind, config, length) for kind in ("edit", "prose")
        for config in (runner.DEFAULT_CHAIN, "prompt-lookup", never_slower.PLAIN_AGAIN) for length in (4, 100, 400)}
    assert data["rounds"] == {4: 4, 100: 2, 400: 1}  # short generations get more rounds
    for r in data["results"]:
        assert r["runs"] == data["rounds"][r["max_tokens"]] and r["identical_to_plain"]
        assert r["min"] <= r["q1"] <= r["median_paired_speedup_vs_plain"] <= r["q3"] <= r["max"]
        assert r["best"] > 0
    named = {entry.rsplit(" ", 1)[0] for entry in data["slower_than_plain"]}
    for r in data["results"]:  # a row under the line is measured again; the recheck's median is its verdict
        flagged = r["median_paired_speedup_vs_plain"] < runner.NEVER_SLOWER and r["config"] != never_slower.PLAIN_AGAIN
        assert ("recheck" in r) == flagged
        assert (f"{r['kind']}/{r['config']}@{r['max_tokens']}" in named) == (
            flagged and r["recheck"]["median"] < runner.NEVER_SLOWER)
    noise = [r["median_paired_speedup_vs_plain"] for r in data["results"] if r["config"] == never_slower.PLAIN_AGAIN]
    assert data["noise_floor"] == {"lowest_median": min(noise), "highest_median": max(noise)}
    top = data["ceiling"]
    assert set(top["ms"]) == {1, 2, 4, 8, 16}
    bound = {k: k * engine.costs.cost(1) / engine.costs.cost(k) for k in (2, 4, 8, 16)}  # the cost table's
    assert top["speedup"] == round(max(bound.values()), 3) and bound[top["best_k"]] == max(bound.values())
    table = never_slower.format_lane(data)
    assert "spread (min..max, IQR)" in table and "under 0.97x of plain" in table and "noise floor" in table
    assert f"wins at most {top['speedup']:.2f}x here" in table
    # (after the cost table's checks: a recheck's forwards update it)
    plain = next(c for c in configs if c.name == runner.PLAIN)
    again = never_slower.recheck(engine, workloads, [*configs, runner.Config(never_slower.PLAIN_AGAIN, plain.spec)],
                                 {"kind": "prose", "config": "prompt-lookup", "max_tokens": 4}, repeats=2)
    assert again["runs"] == never_slower.rounds(2, 4) and again["q1"] <= again["median"] <= again["q3"]
    assert again["plain_again"] > 0
    shown = never_slower.format_lane({**data, "results": [{**data["results"][0], "recheck": again}]})
    assert f"rechecked: {again['median']:.3f}x over {again['runs']} rounds" in shown


def test_the_alternatives_bench_times_n_cmpl_3_against_one_and_each_alternative_alone(engine):
    from codespec.bench.alternatives import CASES, fim_bodies, format_alternatives, run_alternatives

    rows = run_alternatives(engine, repeats=1)
    assert [(r["temperature"], r["prompt_cached"]) for r in rows] == CASES * len(fim_bodies())
    for r in rows:
        sampled = r["temperature"] > 0
        assert len(r["tokens_alone"]) == (3 if sampled else 1) and r["tokens_alone"][0] == r["tokens_1"]
        # (the tiny model's runs take milliseconds: only what rounding cannot break is checked)
        assert r["seconds_longest_alone"] >= r["seconds_1"] and r["ratio_vs_longest"] <= r["ratio"]
        assert r["ratio_vs_longest"] == r["ratio"] or sampled  # greedy: one seed, so the longest is the one
        if not sampled:  # greedy alternatives are one text, three times
            assert r["tokens_3"] == 3 * r["tokens_1"]
    assert "3 / longest" in format_alternatives(rows)


def test_the_predicted_bench_runs_the_configurations_asked_for_with_ratios_paired_to_the_default_chain(tokenizer,
                                                                                                     monkeypatch):
    """--predicted through the HTTP server: each workload in the configurations --predictions names (the default
    chain always, the ratios' base; "its own text" brings plain, whose answer it predicts), alternating their order
    round by round, every text plain's (the default chain's, without plain)."""
    from codespec.bench.predicted import CONFIGS, chosen, format_predicted, run_predicted, workloads
    from codespec.errors import CodespecError

    assert chosen(None) == CONFIGS and chosen("a wrong one") == ("default chain", "a wrong one")
    assert chosen("its own text") == ("plain", "default chain", "its own text")
    with pytest.raises(CodespecError, match="unknown nonsense"):
        chosen("nonsense,plain")
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                        raising=False)  # (the tiny tokenizer has none)
    engine = Engine(tiny_model(context=8192), tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}))
    rows = run_predicted(engine, max_tokens=6, repeats=2, configs=chosen("a wrong one"))
    assert [(r["workload"], r["config"]) for r in rows] == [
        (name, config) for name, _, _ in workloads() for config in ("default chain", "a wrong one")]
    assert all(r["identical_to_plain"] for r in rows)
    assert all(r["paired_vs_default_chain"] == 1.0 for r in rows if r["config"] == "default chain")
    assert "paired" in format_predicted(rows)
