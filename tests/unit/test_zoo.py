"""`codespec bench --zoo` (codespec/bench/zoo.py): its random-weight GGUFs at published shapes load directly in
codespec, with the shapes and tokenizer llama-server needs. (llama-quantize and llama-server are the bench's, built by
build_llama_server: no test needs them.)"""

import json

import gguf
import pytest

from codespec.bench import zoo
from codespec.errors import CodespecError
from codespec.forward import gguf_model
from codespec.forward.models import locate_default_gguf


@pytest.mark.parametrize("arch, tied", [("qwen2", True), ("llama", False)])
def test_a_zoo_file_has_the_shape_and_tokenizer_asked_for_and_loads_directly(tmp_path, arch, tied):
    shape = zoo.Shape(arch, 64, 128, 2, 4, 2, 49200, tied, 1e6, 512)  # 48 unused tokens past the real vocabulary
    path = zoo.write_random_gguf(shape, tmp_path / "tiny-F16.gguf", locate_default_gguf())
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {name for name, _, _ in zoo.tensors(shape)}
    assert ("output.weight" in tensors) == (not tied) and ("blk.0.attn_q.bias" in tensors) == (arch == "qwen2")
    assert tuple(tensors["token_embd.weight"].shape) == (64, 49200)
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "F16"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49200
    assert gguf_model.field(path, f"{arch}.attention.head_count_kv") == 2
    assert gguf_model.direct_problem(path) == "token_embd.weight is F16"  # (llama-quantize makes the zoo's types)
    if not tied:
        return  # (transformers' tokenizer from a GGUF takes ~20 s on 2 cores: once is enough)
    config, tokenizer = gguf_model.metadata(path, tmp_path / "meta")  # what transformers reads of it: the shape
    assert (config.model_type, config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        arch, 64, 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (4, 2, 49200)
    assert len(tokenizer) == 49200 and tokenizer.decode(tokenizer("def f(x):")["input_ids"]) == "def f(x):"
    # named by its folder on the first load as on later ones (adaptive's cost table is kept per name; the file's own
    # directory is every GGUF's in it): a second run measured the table again
    assert config.name_or_path == str(tmp_path / "meta") == gguf_model.metadata(path, tmp_path / "meta")[0].name_or_path
    # read with the vocabulary's arrays skipped (gguf_model.metadata): the config transformers reads with them
    from transformers import AutoConfig

    whole = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    whole.pop("quantization_config", None)
    kept = AutoConfig.for_model(**json.loads((tmp_path / "meta" / "config.json").read_text())).to_dict()
    whole = AutoConfig.for_model(**whole).to_dict()
    mine = {"head_dim", "_name_or_path"}  # (the head size gguf_model adds; where each was read from)
    assert {k: v for k, v in kept.items() if k not in mine} == {k: v for k, v in whole.items() if k not in mine}


def test_the_zoo_names_what_it_cannot_run():
    with pytest.raises(CodespecError, match="unknown llama-9b, Q3_K; shapes: qwen2.5-coder-0.5b"):
        zoo.run(["llama-9b"], ["Q3_K"], None, None, 2)
    with pytest.raises(CodespecError, match="pass --llama-server PATH"):
        zoo.run(["smollm2-1.7b"], ["Q4_0"], None, None, 2)


def test_a_failed_quantization_leaves_no_file_and_a_failing_row_does_not_end_the_run(tmp_path, monkeypatch):
    """llama-quantize stopped or failing leaves no file that a later run would take for a whole one (it writes under
    another name); llama-server refusing one file is that row's error cell, and the next row still runs (a 1.7B
    Q5_K_M left half-written by a stopped run once ended a whole zoo run, its rows unwritten)."""
    import subprocess

    quantizer = tmp_path / "llama-quantize"
    quantizer.write_text('#!/bin/sh\necho half > "$2"\necho "no such type" >&2\nexit 1\n')
    quantizer.chmod(0o755)
    with pytest.raises(CodespecError, match="llama-quantize Q4_0 failed.*no such type"):
        zoo.quantize(quantizer, tmp_path / "m-F16.gguf", tmp_path / "m-Q4_0.gguf", "Q4_0")
    assert not list(tmp_path.glob("m-Q4_0*"))

    (tmp_path / "smollm2-1.7b-F16.gguf").write_bytes(b"f16")
    monkeypatch.setattr(zoo, "quantize", lambda _, __, target, kind: target.write_bytes(kind.encode()) and target)
    measured = '{"engine": "codespec", "load_s": 1.0, "peak_rss_mb": 1, "prefill_tok_s": 2.0, "decode_tok_s": 3.0}'
    monkeypatch.setattr(zoo.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, measured + "\n", ""))

    def llama_server(_, target, __):
        if "Q5_K_M" in target.name:
            raise CodespecError("llama-server plain exited at start (code 1): model loading error")
        return {"engine": "llama-server", "load_s": 1.0, "peak_rss_mb": 1, "prefill_tok_s": 2.0, "decode_tok_s": 2.0}

    monkeypatch.setattr(zoo, "measure_llama_server", llama_server)
    rows = zoo.run(["smollm2-1.7b"], ["Q5_K_M", "Q4_0"], tmp_path, quantizer.with_name("llama-server"), 2)
    assert [row["type"] for row in rows] == ["Q5_K_M", "Q4_0"]
    assert rows[0]["llama-server"] == {"error": "llama-server plain exited at start (code 1): model loading error"}
    assert rows[1]["llama-server"]["decode_tok_s"] == 2.0 and not list(tmp_path.glob("*-Q*.gguf"))
    assert "error: llama-server plain exited" in zoo.format_table(rows) and "Q4_0: decode 1.50x" in zoo.format_table(rows)
