"""A GGUF read directly (codespec/forward/gguf_model.py): the model's projections are placeholders holding no memory,
the lean forward multiplies the file's blocks, and the logits are those of the same file read through a float model."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Type

from codespec.config import ModelConfig
from codespec.errors import CodespecError
from codespec.forward import LeanLlama, forward_path, gguf_model, models
from codespec.forward.plan import lean_unsupported
from tests.gguf_files import k_quant_model, q4_k_m, write_gguf
from tests.tiny import tiny_arch_model, tiny_tokenizer


def saved_metadata(folder, model) -> None:
    """What gguf_model.metadata keeps after a first load (the tests' files carry no tokenizer of their own)."""
    folder.mkdir()
    model.config.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "source.json").write_text(json.dumps({"gguf": "test"}))


def direct(tmp_path, model, **file):
    path = write_gguf(tmp_path / "model.gguf", model, permute=model.config.model_type == "llama", **file)
    saved_metadata(tmp_path / "meta", model)
    return path, *gguf_model.load(path, tmp_path / "meta")


@pytest.mark.parametrize("kind, projections", [("llama", Type.Q4_1), ("qwen2", Type.Q8_0), ("llama", q4_k_m),
                                               ("qwen2", Type.Q5_K), ("qwen3", Type.Q4_0)])
def test_a_gguf_read_directly_holds_no_float_weights_and_gives_the_logits_of_the_float_model(tmp_path, kind,
                                                                                           projections):
    """The direct model's weights take no memory (placeholders; its norms and Qwen2's biases from the file), and its
    lean forward's logits are bit for bit those of the model the file was written from, with --weights gguf (which
    overwrites that model's weights with the file's values): same blocks, same kernels, same norms."""
    model = k_quant_model(kind) if projections in (q4_k_m, Type.Q5_K) else tiny_arch_model(kind, dtype=torch.float32)
    path, loaded, tokenizer = direct(tmp_path, model, projections=projections)
    assert loaded.gguf_direct == path and loaded.device.type == "cpu" and loaded.dtype == torch.float32
    held = sum(p.untyped_storage().nbytes() for p in loaded.parameters())
    small = sum(p.numel() * 4 for name, p in loaded.named_parameters() if "norm" in name or name.endswith("bias"))
    assert held == small + 4 * sum(1 for name, p in loaded.named_parameters() if not ("norm" in name or
                                                                                     name.endswith("bias")))
    assert torch.equal(loaded.model.layers[1].input_layernorm.weight, model.model.layers[1].input_layernorm.weight)
    lean = forward_path(loaded, invariant=True)  # the file's blocks (the plan takes the model's own file)
    assert isinstance(lean, LeanLlama) and lean.direct and lean.plan.weights == "gguf blocks" and lean.plan.invariant
    reference = forward_path(model, gguf=path, activations="auto", invariant=True)
    prompt, draft = list(range(5, 45)), [11, 12, 13, 14, 15]  # 40 rows: a prompt chunk past layers.FEW_ROWS
    caches = [lean.new_cache(), reference.new_cache()]
    for cache, path_ in zip(caches, (lean, reference)):
        path_(cache, prompt, 1)
    assert torch.equal(lean(caches[0], draft, len(draft)), reference(caches[1], draft, len(draft)))


def test_a_direct_model_refuses_the_paths_that_need_float_weights(tmp_path):
    model = tiny_arch_model("llama", dtype=torch.float32)
    _, loaded, _ = direct(tmp_path, model)
    with pytest.raises(CodespecError, match="model.gguf is read directly .* keep --invariant on, or add --weights "
                                            "checkpoint"):
        forward_path(loaded, invariant=False)
    with pytest.raises(CodespecError, match="lean forward"):
        forward_path(loaded, lean=False)


def test_what_cannot_be_read_directly_is_named_and_converted_instead(tmp_path, monkeypatch):
    """Another architecture or a tensor type the tiles do not read: direct_problem says which, and models.load takes
    the conversion path for it (direct_gguf is None); so do the settings that need float weights. A file too large
    for the memory available is one line before a weight is read."""
    model = tiny_arch_model("llama", dtype=torch.float32)
    assert gguf_model.direct_problem(write_gguf(tmp_path / "ok.gguf", model, True)) is None
    assert gguf_model.direct_problem(write_gguf(tmp_path / "bf16.gguf", model, True, Type.BF16)) == (
        "blk.0.attn_q.weight is BF16")
    gemma = write_gguf(tmp_path / "gemma.gguf", tiny_arch_model("gemma3", dtype=torch.float32), False)
    assert gguf_model.direct_problem(gemma) == "architecture 'gemma3_text' (read directly: llama, qwen2, qwen3)"
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(20))
    assert gguf_model.direct_problem(tmp_path / "junk.gguf").startswith("cannot read")
    ok = str(tmp_path / "ok.gguf")
    assert models.direct_gguf(ModelConfig(model=ok)) == tmp_path / "ok.gguf"
    for setting in ({"weights": "checkpoint"}, {"invariant": "off"}, {"forward": "transformers"},
                    {"prompt_precision": "bfloat16"}, {"dtype": "bfloat16"}):
        assert models.direct_gguf(ModelConfig(model=ok, **setting)) is None, setting
    assert models.direct_gguf(ModelConfig(model=str(tmp_path / "bf16.gguf"))) is None
    monkeypatch.setattr(models, "available_memory", lambda: 1000)
    with pytest.raises(CodespecError, match=r"loading ok.gguf takes about .* MB of memory and 0 MB is available"):
        models.load(ModelConfig(model=ok))


def test_the_embedding_is_looked_up_in_the_files_blocks(tmp_path):
    model = tiny_arch_model("qwen2", dtype=torch.float32)
    path, loaded, _ = direct(tmp_path, model, output=Type.Q8_0)
    lean = forward_path(loaded, invariant=True)
    file_values = torch.from_numpy(gguf.quants.dequantize(
        next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight").data, Type.Q8_0))
    ids = np.array([3, 0, 77, 3])
    assert torch.equal(lean.embed_blocks.take(ids), file_values[ids])


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_materialized_gives_transformers_the_files_values(tmp_path, kind):
    """For transformers' own forward (the bench's transformers rows, the default model's identity test): a float32
    model with the blocks' values, q and k in the model's order, whose logits are the direct model's lean forward's
    within float32 sums in another order."""
    model = tiny_arch_model(kind, dtype=torch.float32)
    path, loaded, _ = direct(tmp_path, model)
    full = gguf_model.materialized(loaded)
    forward_path(model, gguf=path, activations="float32")  # (overwrites model's weights with the file's)
    for (name, mine), theirs in zip(full.named_parameters(), model.parameters()):
        assert torch.equal(mine, theirs), name
    ids = list(range(5, 25))
    lean = forward_path(loaded, invariant=True, cache_type="f32", activations="float32")  # (f16 keys and values round more)
    logits = full(torch.tensor([ids])).logits[0, -1]
    assert (logits - lean(lean.new_cache(), ids, 1)[0]).abs().max().item() < 2e-4


def test_metadata_fields_are_read_from_the_header(tmp_path):
    """block_tiles.field: what the direct read takes from the file besides its tensors (the architecture; the head
    size Qwen3 files give as attention.key_length, which transformers' GGUF config mapping misses)."""
    from codespec.forward.kernels import block_tiles

    model = tiny_arch_model("qwen3", dtype=torch.float32)
    path = write_gguf(tmp_path / "model.gguf", model, permute=False)
    assert block_tiles.field(path, "general.architecture") == "qwen3"
    assert block_tiles.field(path, "qwen3.attention.key_length") is None
    writer = gguf.GGUFWriter(str(tmp_path / "keyed.gguf"), "qwen3")
    writer.add_key_length(32)
    writer.add_float32("qwen3.rope.freq_base", 1e6)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert block_tiles.field(tmp_path / "keyed.gguf", "qwen3.attention.key_length") == 32
    assert block_tiles.field(tmp_path / "keyed.gguf", "qwen3.rope.freq_base") == 1e6


def test_the_reader_that_skips_arrays_reads_what_ggufs_own_reads_but_the_arrays():
    """block_tiles.arrays_skipped (every direct load's reader, on plain arrays over the mapping): the default model's
    tensors (names, types, shapes, offsets, blocks) and scalar fields as gguf.GGUFReader reads them; its arrays (the
    vocabulary) stepped over."""
    from codespec.forward.kernels import block_tiles

    path = str(models.locate_default_gguf())
    ours, theirs = block_tiles.arrays_skipped()(path), gguf.GGUFReader(path)
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        if field.types[0] != gguf.GGUFValueType.ARRAY:
            assert [bytes(p) for p in ours.fields[name].parts] == [bytes(p) for p in field.parts], name
        else:
            assert not ours.fields[name].data and len(field.data) > 0, name


def test_released_pages_of_the_mapped_file_read_back_the_same(tmp_path):
    """block_tiles.release gives a tensor's pages back once its blocks are copied (they counted in the process's
    memory while mapped); reading the tensor again faults them back in from the file, unchanged."""
    from codespec.forward.kernels import block_tiles

    path = write_gguf(tmp_path / "model.gguf", tiny_arch_model("llama", dtype=torch.float32), permute=True)
    reader = block_tiles._reader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    before = np.array(tensor.data)
    block_tiles.release(reader, tensor)
    assert np.array_equal(np.array(tensor.data), before)


@pytest.mark.needs_kernels("q8 block tiles")
def test_a_second_load_maps_the_q8_tiles_copy_the_first_kept_and_gives_the_same_logits(tmp_path, monkeypatch):
    """The first load of a file read directly keeps its projections as the q8 tiles read them (forward/repacked.py);
    the next reads no tensor whole from the file (the embedding's rows are decoded as they are looked up), maps the
    copy, and its logits are the first's, bit for bit.
    A damaged copy, or another file written at the same path, is packed afresh; a place nothing can be written to
    keeps nothing, and the load goes on."""
    from codespec.forward.kernels import block_tiles

    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path / "home"))
    model = k_quant_model("llama")
    path, loaded, _ = direct(tmp_path, model, projections=q4_k_m)
    prompt, draft = list(range(5, 45)), [11, 12, 13, 14, 15]

    def logits_and_reads():
        read, reads = block_tiles.Blocks.read, []
        monkeypatch.setattr(block_tiles.Blocks, "read", lambda tensor, rows=None: (
            rows is None and reads.append(tensor.name)) or read(tensor, rows))  # (whole tensors)
        lean = forward_path(loaded, invariant=True, activations="q8")
        monkeypatch.setattr(block_tiles.Blocks, "read", read)
        cache = lean.new_cache()
        lean(cache, prompt, 1)
        return lean(cache, draft, len(draft)), reads

    first, reads = logits_and_reads()
    assert len(reads) == 7 * model.config.num_hidden_layers  # (the output layer repacked a chunk of rows at a time)
    [kept] = (tmp_path / "home" / "repacked").iterdir()
    again, reads = logits_and_reads()
    assert reads == [] and torch.equal(again, first)
    size = kept.stat().st_size
    with open(kept, "r+b") as file:  # damaged: cut short
        file.truncate(size // 2)
    again, reads = logits_and_reads()
    assert len(reads) > 1 and torch.equal(again, first) and kept.stat().st_size > size // 2
    again, reads = logits_and_reads()  # (written again whole: its arrays in the order the threads packed them)
    assert reads == [] and torch.equal(again, first)
    other = k_quant_model("llama")
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(2)
    write_gguf(path, other, permute=True, projections=q4_k_m)  # another file at the same path
    changed, reads = logits_and_reads()
    assert len(reads) > 1 and not torch.equal(changed, first)
    monkeypatch.setenv("CODESPEC_HOME", str(path))  # under a file: nothing can be written there
    again, reads = logits_and_reads()
    assert len(reads) > 1 and torch.equal(again, changed) and not list(tmp_path.glob("**/*.partial"))


@pytest.mark.needs_kernels("q8 block tiles")
def test_a_first_load_that_fails_half_way_leaves_no_half_written_copy(tmp_path, monkeypatch):
    """The copy a first load writes as it packs (repacked.Keeper) is removed when a tensor cannot be read half-way
    through the file (not left for a day: a 7B's is ~5 GB); the next load packs and keeps a whole one."""
    import gc

    from codespec.forward.kernels import block_tiles

    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path / "home"))
    _, loaded, _ = direct(tmp_path, k_quant_model("llama"), projections=q4_k_m)
    read, reads = block_tiles.Blocks.read, []

    def failing(tensor, rows=None):
        reads.append(tensor.name)
        if len(reads) > 5:
            raise CodespecError(f"cannot read {tensor.name}")
        return read(tensor, rows)

    monkeypatch.setattr(block_tiles.Blocks, "read", failing)
    with pytest.raises(CodespecError, match="cannot read"):
        forward_path(loaded, invariant=True, activations="q8")
    gc.collect()  # (the failed forward, and its Keeper, in the exception's frames)
    assert len(reads) > 5 and not list((tmp_path / "home").glob("**/*.partial"))
    monkeypatch.setattr(block_tiles.Blocks, "read", read)
    forward_path(loaded, invariant=True, activations="q8")
    assert [copy.suffix for copy in (tmp_path / "home" / "repacked").iterdir()] == [".bin"]


def test_a_later_run_on_the_default_model_imports_neither_transformers_nor_a_c_parser():
    """What a second `codespec generate --chat` spends before its first token: transformers (~1 s to import: it reads
    every model's source for its lazy import table) is for models it converts and the first load's metadata (the
    config and tokenizer are then kept, and read back without it: tokenizer.SavedTokenizer), and cffi's C parser
    (0.16 s, built by numba's cffi support the first time it types anything) for cffi functions codespec never hands
    numba. cffi itself stays importable. Run twice: the first run may be the machine's first load."""
    code = ("import sys\nfrom codespec.engine import Engine\nfrom codespec.config import SamplingParams\n"
            "engine = Engine.load(show_progress=False)\n"
            "ids = engine.encode('Say hi.', chat=True)\n"
            "print(engine.generate(ids, SamplingParams(max_tokens=4)).text.strip() != '')\n"
            "print([name for name in ('transformers', 'huggingface_hub', 'pycparser.c_parser') if name in sys.modules])\n"
            "import importlib.util\nif importlib.util.find_spec('cffi'):\n    import cffi\n    cffi.FFI()\n")
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-2:] == ["True", "[]"]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("rope", [None, "llama3", "linear", "yarn"])
def test_a_direct_model_is_transformers_tree_of_parts_and_rotary_frequencies(kind, rope):
    """DirectModel (no transformers model class: importing those took a second of every load) has the parameters,
    shapes and biases transformers' model of the same config has, and its rotary frequencies and factor on cos and
    sin are the ones transformers' rotary module computes, rope scaling included."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    from tests.unit.test_forward import ROPE_SCALING

    config = tiny_arch_model(kind, dtype=torch.float32).config
    if rope is not None:
        config.rope_parameters = ROPE_SCALING[rope]
    theirs = AutoModelForCausalLM.from_config(config)
    ours = gguf_model.DirectModel(PretrainedConfig(**config.to_dict()), "model.gguf")
    assert {name: p.shape for name, p in ours.named_parameters()} == {
        name: p.shape for name, p in theirs.named_parameters()}
    assert torch.equal(ours.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq)
    assert ours.model.rotary_emb.attention_scaling == theirs.model.rotary_emb.attention_scaling
    assert lean_unsupported(ours) is None and lean_unsupported(theirs) is None


def test_kept_copies_map_back_what_was_saved_and_go_when_their_gguf_goes(tmp_path, monkeypatch):
    """repacked.save / load on their own: the arrays come back equal and writable (numba's usual array type), each
    at a 64-byte boundary, only for the instruction set and q scale they were kept for; the copy of a GGUF that is
    gone is removed when another is written, as is a damaged one."""
    from codespec.forward import repacked
    from codespec.forward.kernels.q8_tiles import Form

    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path / "home"))
    rng = np.random.default_rng(0)
    packed = [(rng.integers(0, 256, (3, 130), dtype=np.uint8), rng.integers(0, 256, (3, 70), dtype=np.uint8),
               Form(nibbles=True, scales=2, wide=True), 40, 7),
              (rng.integers(0, 256, (1, 64), dtype=np.uint8), rng.integers(0, 256, (1, 32), dtype=np.uint8),
               Form(nibbles=False, minimum=False, planes=2, offset=32), 16, 1)]
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(b"GGUF first")
    second.write_bytes(b"GGUF second")
    repacked.save(first, "vnni", 0.125, packed)
    kept = repacked.load(first, "vnni", 0.125)
    for (q, held, form, rows, groups), (q2, held2, form2, rows2, groups2) in zip(packed, kept, strict=True):
        assert np.array_equal(q, q2) and np.array_equal(held, held2) and (form, rows, groups) == (form2, rows2, groups2)
        assert q2.flags.writeable and q2.ctypes.data % 64 == 0 and held2.ctypes.data % 64 == 0
    assert repacked.load(first, "avx2", 0.125) is None and repacked.load(first, "vnni", 1.0) is None
    [copy] = (tmp_path / "home" / "repacked").iterdir()
    first.unlink()
    repacked.save(second, "vnni", 0.125, packed[:1])
    assert [p.name for p in (tmp_path / "home" / "repacked").iterdir()] != [copy.name] and not copy.exists()
    [other] = (tmp_path / "home" / "repacked").iterdir()
    other.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")  # a header length no copy has
    assert repacked.load(second, "vnni", 0.125) is None
    third = tmp_path / "c.gguf"
    third.write_bytes(b"GGUF third")
    repacked.save(third, "vnni", 0.125, packed)
    assert not other.exists() and repacked.load(third, "vnni", 0.125) is not None
