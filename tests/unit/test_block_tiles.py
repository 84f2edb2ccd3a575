"""--weights gguf: a GGUF's own Q4_1 / Q8_0 blocks in the few-row forward (codespec/forward/kernels/block_tiles.py)."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Type
from gguf import quants

from codespec.forward.kernels import block_tiles
from codespec.errors import CodespecError
from codespec.forward import LeanLlama, Rows, forward_path
from tests.tiny import tiny_arch_model

NO_NORM = np.zeros(0, dtype=np.float32)


def random_blocks(kind: str, outputs: int, inputs: int, seed: int = 0) -> block_tiles.Blocks:
    rng = np.random.default_rng(seed)
    block, minimum = block_tiles.KINDS[kind]
    scales = (rng.random((outputs, inputs // 32)) * 0.1).astype(np.float16).astype(np.float32)
    minimums = (rng.random((outputs, inputs // 32)) - 0.5).astype(np.float16).astype(np.float32)
    return block_tiles.Blocks(kind, rng.integers(0, 256, (outputs, inputs // 32 * block), dtype=np.uint8), scales,
                            minimums if minimum else np.zeros_like(scales))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_the_kernel_multiplies_by_the_blocks_values_and_a_row_gets_the_same_bits_in_any_batch(kind):
    """Each (row, column) is the same sequence of float operations in every tile: a row's result is the same
    whether it comes alone or in a tile of several (11 rows: 4 + 4 + 2 + 1 with AVX-512, 2 + ... + 1 with AVX2)."""
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


@pytest.mark.parametrize("kind", [Type.Q4_1, Type.Q8_0])
def test_the_blocks_values_are_gguf_own_dequantisation(kind):
    weight = np.random.default_rng(3).standard_normal((8, 96)).astype(np.float32)
    raw = quants.quantize(weight, kind)
    tensor = type("Tensor", (), {"name": "t", "tensor_type": kind, "data": raw})
    values = block_tiles.Blocks.read(tensor).values().numpy()
    assert np.array_equal(values, quants.dequantize(raw, kind))


def llama_cpp_order(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert script: each Llama head's rotated pairs side by side."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path, model, permute: bool, projections=Type.Q4_1, output=Type.Q8_0):
    """The model's weights quantised into a GGUF laid out as llama.cpp writes one (q/k permuted for Llama)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    config = model.config

    def add(name, weight, kind):
        writer.add_tensor(name, quants.quantize(weight.detach().float().numpy(), kind), raw_dtype=kind)

    add("token_embd.weight", model.model.embed_tokens.weight, output)
    add("output.weight", model.lm_head.weight, output)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k = attn.q_proj.weight, attn.k_proj.weight
        if permute:
            q, k = llama_cpp_order(q, config.num_attention_heads), llama_cpp_order(k, config.num_key_value_heads)
        for name, weight in (("attn_q", q), ("attn_k", k), ("attn_v", attn.v_proj.weight),
                             ("attn_output", attn.o_proj.weight), ("ffn_gate", mlp.gate_proj.weight),
                             ("ffn_up", mlp.up_proj.weight), ("ffn_down", mlp.down_proj.weight)):
            add(f"blk.{i}.{name}.weight", weight, projections)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind, permute", [("llama", True), ("llama", False), ("qwen2", False)])
def test_the_model_takes_the_files_values_and_the_numba_path_reads_its_blocks(tmp_path, kind, permute):
    model = tiny_arch_model(kind, dtype=torch.float32)
    path = write_gguf(tmp_path / "tiny.gguf", model, permute)
    before = model.model.layers[1].self_attn.q_proj.weight.clone()
    lean = forward_path(model, gguf=path, activations="float32")  # test_q8.py: the rounded activations
    assert isinstance(lean, LeanLlama) and isinstance(lean.kernel_weights.head, tuple)
    file_q = quants.dequantize(gguf.GGUFReader(str(path)).get_tensor(9).data, Type.Q4_1)  # blk.1.attn_q
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
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
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
    unsupported = write_gguf(tmp_path / "q5.gguf", model, permute=True, projections=Type.Q5_0)
    with pytest.raises(CodespecError, match="reads Q4_1 and Q8_0 blocks; blk.0.attn_q.weight is Q5_0"):
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
    q5 = write_gguf(tmp_path / "q5.gguf", model, permute=True, projections=Type.Q5_0)
    assert block_tiles.unreadable(q5) == "blk.0.attn_q.weight is Q5_0"
    assert auto_gguf(model, "lean", q5) is None
