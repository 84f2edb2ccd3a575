"""codespec.bench.cuda's sessions and shapes sections on a CPU (`--device cpu`): their plumbing, not their figures
(those need a GPU: the module's docstring says how; CODESPEC_TEST_DEVICE=cuda runs the first test there, with
kernels counted). The stacked forward of each bucket of sessions at k=1 and k=16, the random-weight models of zoo's
shapes made on the device in their dtype, kernels null off CUDA, and a choice of operations that cannot run here
skipped with why."""

import json

import pytest
import torch

from codespec.bench import cuda, cuda_sessions
from codespec.bench.zoo import SHAPES as ZOO_SHAPES
from codespec.forward import graphs
from tests.tiny import DEVICE

FIELDS = {"ops", "sessions", "ms", "rows_per_s", "rows_per_s_vs_one_session", "kernels", "launch_floor_ms",
          "memory_floor_ms", "memory_floor_filled_ms", "memory_ratio"}


def keyed(row: dict, name: str) -> dict:
    return {int(k): v for k, v in row[name].items()}  # (JSON keys are strings)


def check_kernels(row: dict, launch_us: float) -> None:
    """Kernels per forward and the launch floor: counted on CUDA, null elsewhere."""
    if DEVICE != "cuda":
        assert keyed(row, "kernels") == {1: None, 16: None}
        if "launch_floor_ms" in row:
            assert keyed(row, "launch_floor_ms") == {1: None, 16: None}
        return
    counts = keyed(row, "kernels")
    assert sorted(counts) == [1, 16] and all(count > 0 for count in counts.values())
    if "launch_floor_ms" in row:
        assert keyed(row, "launch_floor_ms") == {k: round(counts[k] * launch_us / 1e3, 3) for k in (1, 16)}


def test_sessions_and_shapes_run_on_the_device(tmp_path, capsys):
    code = cuda.main(["--out", str(tmp_path), "--device", DEVICE, "--sections", "sessions", "--random", "--model",
                      "tiny", "--shapes", "tiny", "--session-dtypes", "bfloat16", "--cached", "24", "--timed", "2"])
    assert code == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["sessions-bfloat16.json", "shapes-bfloat16.json"]
    sessions = json.loads((tmp_path / "sessions-bfloat16.json").read_text())
    assert sessions["device_type"] == DEVICE and sessions["dtype"] == "bfloat16" and sessions["cached"] == 24
    ran = ["torch"] if DEVICE != "cuda" else [ops for ops in ("torch", "triton") if ops not in sessions["skipped"]]
    assert "torch" in ran and list(sessions["paths"]) == ran and set(sessions["paths"]) | set(sessions["skipped"]) \
        == ({"torch"} if DEVICE != "cuda" else {"torch", "triton"})
    assert all(sessions["paths"][ops]["ops"] == ops and sessions["paths"][ops]["cache_slot_mb"] > 0 for ops in ran)
    # bfloat16 layers and a float32 head: more than the model's weights (tiny: untied, 384 x 64 embeddings and head)
    head_mb = 384 * 64 * 4 / 1e6
    assert all(sessions["paths"][ops]["forward_weights_mb"] == pytest.approx(
        sessions["weights_mb"] - 384 * 64 * 2 * 2 / 1e6 + head_mb, abs=0.01) for ops in ran)
    buckets = getattr(graphs.GraphLlama, "buckets", cuda_sessions.BUCKETS)
    # one row per bucket (and per operations run)
    assert [(row["ops"], row["sessions"]) for row in sessions["rows"]] == [(ops, b) for ops in ran for b in buckets]
    for ops in ran:
        rows = [row for row in sessions["rows"] if row["ops"] == ops]
        one = rows[0]
        for row in rows:
            assert set(row) == FIELDS
            ms = keyed(row, "ms")
            assert sorted(ms) == [1, 16] and all(value > 0 for value in ms.values())
            for k in (1, 16):
                assert keyed(row, "rows_per_s")[k] == pytest.approx(row["sessions"] * k / (ms[k] / 1e3), rel=1e-3)
                gain = row["sessions"] * keyed(one, "ms")[k] / ms[k]
                assert keyed(row, "rows_per_s_vs_one_session")[k] == pytest.approx(gain, rel=1e-2, abs=2e-3)
                assert keyed(row, "memory_ratio")[k] == pytest.approx(ms[k] / row["memory_floor_ms"], rel=1e-2,
                                                                      abs=0.02)
            check_kernels(row, sessions["launch_us"])
            assert 0 < row["memory_floor_filled_ms"] < row["memory_floor_ms"]
        assert keyed(one, "rows_per_s_vs_one_session") == {1: 1.0, 16: 1.0}
        # the floor grows by one cache slot per session, over the weights
        floors = [row["memory_floor_ms"] for row in rows]
        slot = (floors[1] - floors[0]) / (buckets[1] - buckets[0])
        assert slot > 0 and all(floor == pytest.approx(floors[0] + (b - 1) * slot, rel=1e-2)
                                for floor, b in zip(floors, buckets))
    shapes = json.loads((tmp_path / "shapes-bfloat16.json").read_text())
    assert shapes["dtype"] == "bfloat16" and shapes["device_type"] == DEVICE
    rows = [row for row in shapes["rows"] if "error" not in row]
    assert [row["shape"] for row in shapes["rows"]] == ["tiny"] * (1 if DEVICE != "cuda" else 2)  # per operations
    assert [row["ops"] for row in rows] == ran  # where the sessions section ran them
    for row in rows:
        assert row["context"] == cuda_sessions.SHAPES["tiny"].context and row["cache_slot_mb"] > 0
        ms = keyed(row, "ms")
        assert sorted(ms) == [1, 16] and all(value > 0 for value in ms.values())
        check_kernels(row, shapes["launch_us"])
        assert row["memory_floor_ms"] > 0 and keyed(row, "memory_ratio")[16] == pytest.approx(
            ms[16] / row["memory_floor_ms"], rel=1e-2, abs=0.02)
    printed = capsys.readouterr().out
    assert "B sessions x k rows in one forward" in printed and "one session's forward" in printed
    assert len([line for line in printed.splitlines() if line.startswith(("torch ", "triton "))]) == len(
        sessions["rows"])


def test_a_shape_is_made_on_the_device_in_its_dtype(monkeypatch):
    """The 7B's bfloat16 weights are made where they run (here the meta device: no memory), never in float32."""
    from transformers import AutoModelForCausalLM

    made, build = [], AutoModelForCausalLM.from_config

    def spy(config, **kwargs):
        made.append((torch.get_default_device().type, kwargs.get("dtype"), config.dtype))
        return build(config, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", spy)
    model = cuda_sessions.shape_model(cuda_sessions.SHAPES["qwen2.5-coder-7b"], "meta", torch.bfloat16)
    assert made == [("meta", torch.bfloat16, torch.bfloat16)]  # built there in bfloat16, not moved nor cast after
    parameters = list(model.parameters())
    assert {p.device.type for p in parameters} == {"meta"} and {p.dtype for p in parameters} == {torch.bfloat16}
    assert 7.5e9 < sum(p.numel() for p in parameters) < 7.7e9  # Qwen2.5-Coder-7B: 7.62B parameters
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (
        3584, 28, 4, 152064)
    assert not config.tie_word_embeddings and model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's
    llama = cuda_sessions.shape_config(cuda_sessions.SHAPES["llama-3.2-3b"], torch.bfloat16)
    assert llama.model_type == "llama" and llama.tie_word_embeddings and llama.head_dim == 128
    assert all(cuda_sessions.SHAPES[name] == shape for name, shape in ZOO_SHAPES.items())  # zoo's table, not another


def test_operations_that_cannot_run_here_are_skipped_with_why_and_the_others_run():
    """Triton's kernels on a CPU's tensors (compiled for a GPU) cannot run: the sessions section says so and still
    measures PyTorch's."""
    model = cuda_sessions.shape_model(cuda_sessions.SHAPES["tiny"], "cpu", torch.float32)
    data = cuda_sessions.sessions_section(model, ["torch", "triton"], cached=8, repeats=1, measured=(1e10, 5.0))
    assert set(data["skipped"]) == {"triton"} and data["skipped"]["triton"]
    assert {row["ops"] for row in data["rows"]} == {"torch"}
    assert "triton: not run" in cuda_sessions.format_sessions(data)


def test_the_cuda_device_is_required_where_asked_for(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda.main(["--out", str(tmp_path), "--sections", "sessions", "--random"]) == 1
    assert "--device cpu" in capsys.readouterr().err
    assert cuda.main(["--out", str(tmp_path), "--device", "cpu", "--sections", "identity"]) == 1
    with pytest.raises(SystemExit, match="unknown nope"):
        cuda_sessions.shapes_section(["nope"], "cpu", torch.bfloat16, ["torch"], measured=(1e10, 5.0))
