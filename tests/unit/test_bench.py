"""`codespec bench` end to end on the tiny model: every class runs, outputs match plain, files are written."""

import json


from codespec.bench import runner
from codespec.bench.workloads import all_workloads
from codespec.config import SpecConfig
from codespec.engine import Engine
from tests.tiny import EOS, tiny_model


def test_quick_bench_on_the_tiny_model(tokenizer, tmp_path):
    engine = Engine(tiny_model(context=8192), tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}))
    workloads = all_workloads(1)
    assert {w.kind for w in workloads} == {"edit", "completion", "multi-turn", "free-form"}
    configs = runner.build_configs(quick=False, draft_max=8, default_spec=SpecConfig(draft_max=8))
    rows = runner.run_bench(engine, workloads, configs, repeats=2, max_tokens=8, turns=3)
    data = runner.report(rows, {"device": engine.model.device, "dtype": "float64", "max_tokens": 8, "repeats": 2})
    assert all(r["identical_to_plain"] for r in data["results"]), [r for r in data["results"] if not r["identical_to_plain"]]
    assert len(data["results"]) == len(workloads) * len(configs)
    multi = [r for r in data["results"] if r["kind"] == "multi-turn" and r["config"] == runner.PLAIN][0]
    assert multi["tokens"] > 8  # three turns' worth of tokens
    assert {s["kind"] for s in data["by_class"]} == {"edit", "completion", "multi-turn", "free-form"}
    (tmp_path / "bench.json").write_text(json.dumps(data))
    runner.plot(data, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "codespec default" in runner.format_table(data)
