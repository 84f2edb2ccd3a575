"""--weights gguf: a GGUF's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) in the few-row forward
(codespec/forward/kernels/block_tiles.py)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Type
from gguf import quants

from codespec.forward.kernels import block_tiles
from codespec.errors import CodespecError
from codespec.forward import LeanLlama, Rows, forward_path
from tests.gguf_files import k_quant_model, q4_k_m, quantize, random_blocks, tensor, write_gguf
from tests.tiny import tiny_arch_model

NO_NORM = np.zeros(0, dtype=np.float32)


LAYOUTS = [*block_tiles.KINDS.values(), block_tiles.Layout(8, True, 2), block_tiles.Layout(4, True, 2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_the_kernel_multiplies_by_the_blocks_values_and_a_row_gets_the_same_bits_in_any_batch(layout):
    """Each (row, column) is the same sequence of float operations in every tile: a row's result is the same
    whether it comes alone or in a tile of several (11 rows: 4 + 4 + 2 + 1 with AVX-512, 2 + ... + 1 with AVX2).
    Every layout: nibbles or bytes; a minimum, an offset or neither; a scale per 32 or per 16 weights (and the
    ones the fused projections of mixed files make)."""
    kind = block_tiles.kind_of(layout)
    blocks = random_blocks(kind, 45, 192)
    weights = blocks.values().double().numpy()
    x = np.random.default_rng(1).standard_normal((11, 192)).astype(np.float32)
    together = block_tiles.linear(x, NO_NORM, np.float32(1e-5), blocks.weight())
    assert together.shape == (11, 45)
    assert np.abs(together - x.astype(np.float64) @ weights.T).max() < 1e-5 * np.abs(together).max()
    alone = np.concatenate([block_tiles.linear(x[i : i + 1], NO_NORM, np.float32(1e-5), blocks.weight())
                            for i in range(11)])
    assert np.array_equal(alone, together)
    norm = np.random.default_rng(2).random(192).astype(np.float32) + 0.5
    normed = block_tiles.linear(x, norm, np.float32(1e-5), blocks.weight())
    expected = torch.rms_norm(torch.from_numpy(x).double(), [192], torch.from_numpy(norm).double(), 1e-5)
    assert np.abs(normed - expected.numpy() @ weights.T).max() < 1e-5 * np.abs(normed).max()


FILE_TYPES = [Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.Q4_K, Type.Q5_K, Type.Q6_K]


@pytest.mark.parametrize("kind", FILE_TYPES, ids=lambda kind: kind.name)
def test_every_file_type_runs_in_the_tiles_as_gguf_dequantizes_it(kind):
    """Each GGUF type's blocks, read into their tile layout, hold exactly gguf.quants.dequantize's weights, and the
    kernel multiplies by them: against a float64 product of those weights, and the same bits for a row alone or in
    a tile. The K-quants come from tests/kquants.py's encoder (gguf 0.19 cannot write them): its blocks round trip
    through gguf's own decoder to the weights it encoded, within a quantisation step."""
    weight = np.random.default_rng(3).standard_normal((40, 512)).astype(np.float32)
    raw = quantize(weight, kind)
    reference = quants.dequantize(raw, kind)
    assert np.abs(reference - weight).max() < 0.5 * np.abs(weight).max()
    tensor = type("Tensor", (), {"name": "t", "tensor_type": kind, "data": raw})
    blocks = block_tiles.Blocks.read(tensor)
    assert blocks.source == kind.name
    assert np.array_equal(blocks.values().numpy(), reference)
    x = np.random.default_rng(4).standard_normal((5, 512)).astype(np.float32)
    together = block_tiles.linear(x, NO_NORM, np.float32(1e-5), blocks.weight())
    exact = x.astype(np.float64) @ reference.astype(np.float64).T
    assert np.abs(together - exact).max() < 1e-5 * np.abs(exact).max()
    alone = np.concatenate([block_tiles.linear(x[i : i + 1], NO_NORM, np.float32(1e-5), blocks.weight())
                            for i in range(5)])
    assert np.array_equal(alone, together)


def test_projections_fused_from_different_types_share_one_layout_that_holds_them_all():
    """A Q4_K_M file keeps q and k in Q4_K and v (in some layers) in Q6_K: fused into one q/k/v, they go into one
    layout that holds them all (the most bits, a minimum, a scale per 16 weights), each weight unchanged."""
    rng = np.random.default_rng(5)
    parts = [block_tiles.Blocks.read(type("Tensor", (), {"name": "t", "tensor_type": kind, "data": quantize(
        rng.standard_normal((16, 256)).astype(np.float32), kind)})) for kind in (Type.Q4_K, Type.Q6_K, Type.Q8_0)]
    fused = block_tiles.Blocks.cat(parts)
    assert fused.kind == "L8mx2o0" and fused.source == "Q4_K+Q6_K+Q8_0"
    assert torch.equal(fused.values(), torch.cat([p.values() for p in parts]))
    assert block_tiles.Blocks.cat(parts[:1] * 2).kind == "Q4_1"
    assert block_tiles.Blocks.cat([parts[0], parts[2]]).kind == "Q8_M"
    assert block_tiles.Blocks.cat(parts[:2]).kind == "L8mx2o0"  # (Q4_K_M's q/k/v: bytes, a minimum, two scales)
    for pair in (parts[:2], [parts[0], parts[2]]):
        assert torch.equal(block_tiles.Blocks.cat(pair).values(), torch.cat([p.values() for p in pair]))


@pytest.mark.parametrize("kind, permute", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", False)])
def test_the_model_takes_the_files_values_and_the_numba_path_reads_its_blocks(tmp_path, kind, permute):
    model = tiny_arch_model(kind, dtype=torch.float32)
    path = write_gguf(tmp_path / "tiny.gguf", model, permute)
    before = model.model.layers[1].self_attn.q_proj.weight.clone()
    lean = forward_path(model, gguf=path, activations="float32")  # test_q8.py: the rounded activations
    assert isinstance(lean, LeanLlama) and isinstance(lean.kernel_weights.head, tuple)
    file_q = quants.dequantize(tensor(path, "blk.1.attn_q.weight").data, Type.Q4_1)
    expected = torch.from_numpy(file_q)
    if permute:  # back to the model's order
        heads, dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
        expected = expected.view(heads, dim // 2, 2, -1).swapaxes(1, 2).reshape(before.shape)
    now = model.model.layers[1].self_attn.q_proj.weight
    assert torch.equal(now, expected) and not torch.equal(now, before)
    ids = [5, 17, 3, 99, 42, 7]
    numba_cache, torch_cache = lean.new_cache(), lean.new_cache()
    numba_logits = lean(numba_cache, ids, 2)  # 6 rows: the numba path (layers.FEW_ROWS is 16)
    blocks, lean.kernel_weights = lean.kernel_weights, None
    torch_logits = lean(torch_cache, ids, 2)  # the same weights in PyTorch's float32 path
    lean.kernel_weights = blocks
    # (float32 sums in two orders: within 1e-4 of logits ~2 on AVX-512, 1.02e-4 seen on an AVX2 CPU)
    assert (numba_logits - torch_logits).abs().max().item() < 2e-4
    step = lean(numba_cache, [11], 1)
    assert (step - lean.batch([Rows(torch_cache, [11], 1)])[0]).abs().max().item() < 2e-4


@pytest.mark.parametrize("activations, draft_length", [
    ("float32", 4), *(pytest.param("q8", n, marks=pytest.mark.needs_kernels("q8 block tiles")) for n in (4, 24))])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_verify_forward_gives_each_row_the_logits_of_decoding_it_alone_bit_for_bit(tmp_path, kind, activations,
                                                                                  draft_length):
    """The projections compute each row alone (above and test_q8.py: the same bits in any batch), and so does
    attention over the cache (attention.py: each row's keys in the same blocks, its softmax over its own keys): on
    this path speculation cannot change a single bit, nor can the other sessions of a batch. With q8 activations,
    forwards of any length (here 24 rows, past layers.FEW_ROWS) take this path."""
    model = tiny_arch_model(kind, dtype=torch.float32)
    lean = forward_path(model, gguf=write_gguf(tmp_path / "tiny.gguf", model, permute=kind == "llama"),
                        activations=activations)
    assert lean.q8 == (activations == "q8")
    prompt, draft = [5, 17, 3, 99, 42, 7, 8, 9], [11, 12, 13, 14, 15, 16, 18, 19, 20, 21, 22, 23] * 2
    draft = draft[:draft_length]
    verify, decode, other = lean.new_cache(), lean.new_cache(), lean.new_cache()
    lean(verify, prompt, 1)
    lean(decode, prompt, 1)
    lean(other, list(range(20, 57)), 1)
    together = lean(verify, draft, len(draft))
    alone = torch.cat([lean(decode, [token], 1) for token in draft])
    assert torch.equal(together, alone)
    verify.crop(len(prompt))
    beside = lean.batch([Rows(other, [3, 4, 5], 3), Rows(verify, draft, len(draft))])[1]
    assert torch.equal(beside, alone)


def test_gguf_weights_refuse_what_they_cannot_run(tmp_path):
    model = tiny_arch_model("llama", dtype=torch.float32)
    unsupported = write_gguf(tmp_path / "bf16.gguf", model, permute=True, projections=Type.BF16)
    with pytest.raises(CodespecError, match="reads Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K blocks; "
                                            "blk.0.attn_q.weight is BF16"):
        forward_path(model, gguf=unsupported)
    path = write_gguf(tmp_path / "tiny.gguf", model, permute=True)
    with pytest.raises(CodespecError, match="CPUs in float32"):
        forward_path(tiny_arch_model("llama", dtype=torch.float64), gguf=path)
    with pytest.raises(CodespecError, match="lean forward"):
        forward_path(tiny_arch_model("gemma3", dtype=torch.float32), gguf=path)
    with pytest.raises(CodespecError, match="lean forward"):
        forward_path(model, lean=False, gguf=path)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(CodespecError, match="cannot read"):
        forward_path(model, gguf=tmp_path / "junk.gguf")


def test_weights_auto_picks_the_blocks_only_where_they_run(tmp_path):
    from codespec.forward import auto_gguf

    model = tiny_arch_model("llama", dtype=torch.float32)
    path = write_gguf(tmp_path / "tiny.gguf", model, permute=True)
    assert auto_gguf(model, "lean", path) == path
    assert auto_gguf(model, "lean", None) is None  # a checkpoint directory: no GGUF behind it
    assert auto_gguf(model, "transformers", path) is None
    assert auto_gguf(tiny_arch_model("llama", dtype=torch.float64), "lean", path) is None
    assert auto_gguf(tiny_arch_model("gemma3", dtype=torch.float32), "lean", path) is None
    bf16 = write_gguf(tmp_path / "bf16.gguf", model, permute=True, projections=Type.BF16)
    assert block_tiles.unreadable(bf16) == "blk.0.attn_q.weight is BF16"
    assert auto_gguf(model, "lean", bf16) is None


@pytest.mark.parametrize("projections", [Type.Q4_0, Type.Q5_0, Type.Q5_1, Type.Q4_K, Type.Q5_K, Type.Q6_K, q4_k_m],
                         ids=lambda p: getattr(p, "name", None) or p.__name__)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_model_in_every_file_type_runs_the_blocks_and_verifies_bit_for_bit(tmp_path, kind, projections):
    """A model whose file holds each type (and Q4_K_M's mix of Q4_K and Q6_K, fused into one q/k/v): the model takes
    the file's values, the tiles read its blocks, and a verify forward gives each row the bits of decoding it
    alone, as on the default model's Q4_1."""
    model = k_quant_model(kind)
    path = write_gguf(tmp_path / "tiny.gguf", model, permute=kind == "llama", projections=projections,
                      output=Type.Q6_K)
    lean = forward_path(model, gguf=path, activations="float32")
    assert lean.plan.weights == "gguf blocks"
    down = tensor(path, "blk.0.ffn_down.weight")  # (not reordered)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight,
                       torch.from_numpy(quants.dequantize(down.data, down.tensor_type)))
    prompt, draft = [5, 17, 3, 99, 42, 7, 8, 9], [11, 12, 13, 14, 15, 16]
    verify, decode, plain = lean.new_cache(), lean.new_cache(), lean.new_cache()
    lean(verify, prompt, 1)
    lean(decode, prompt, 1)
    together = lean(verify, draft, len(draft))
    alone = torch.cat([lean(decode, [token], 1) for token in draft])
    assert torch.equal(together, alone)
    blocks, lean.kernel_weights = lean.kernel_weights, None
    lean(plain, prompt, 1)
    in_pytorch = lean(plain, draft, len(draft))  # the same weights in PyTorch's float32 path
    lean.kernel_weights = blocks
    assert (in_pytorch - together).abs().max().item() < 1e-3 * max(1.0, together.abs().max().item())


def test_q8_activations_take_every_file_on_either_instruction_set(tmp_path, monkeypatch):
    """Every block type, a q/k/v fused from 4- and 8-bit blocks, and q's scales times 1/sqrt(head_dim) below
    float16's normal range (the default model requantized to Q8_0 was once `the scales are not float16 values`, an
    internal error, and later float32 activations on VNNI CPUs) all run q8 activations under auto, on AVX2 and on
    AVX512-VNNI alike (the plan only; test_q8.py multiplies each layout in both)."""
    from codespec.forward import plan as plans

    model = tiny_arch_model("llama", dtype=torch.float32)
    fine = write_gguf(tmp_path / "q4_1.gguf", model, permute=True)
    k = write_gguf(tmp_path / "k.gguf", k_quant_model("llama"), True, Type.Q4_K)
    mixed = write_gguf(tmp_path / "mixed.gguf", model, True, lambda name: Type.Q8_0 if "attn_v" in name else Type.Q4_1)
    monkeypatch.setattr(plans.q8_tiles, "available", lambda: True)
    for isa in ("avx2", "vnni"):
        monkeypatch.setattr(plans.q8_tiles, "instruction_set", lambda: isa)
        assert all(plans.q8_activations("auto", path) for path in (fine, k, mixed))
        assert plans.q8_activations("q8", k) and not plans.q8_activations("float32", fine)
    assert not plans.q8_activations("auto", None)


@pytest.mark.parametrize("kind", [Type.Q6_K, Type.Q4_0], ids=lambda kind: kind.name)
def test_a_large_tensor_is_read_a_chunk_of_rows_at_a_time_into_the_same_blocks(kind, monkeypatch):
    """Blocks.read decodes READ_ROWS rows at a time (a whole 152k-row output layer's temporaries took GBs): the same
    bytes as one pass."""
    weight = np.random.default_rng(6).standard_normal((50, 256)).astype(np.float32)
    tensor = type("Tensor", (), {"name": "t", "tensor_type": kind, "data": quantize(weight, kind)})
    whole = block_tiles.Blocks.read(tensor)
    monkeypatch.setattr(block_tiles, "READ_ROWS", 16)
    chunked = block_tiles.Blocks.read(tensor)
    assert all(np.array_equal(getattr(whole, a), getattr(chunked, a)) for a in "qdm")
