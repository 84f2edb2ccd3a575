"""A prompt chunk's attention in bfloat16 tiles (prompt_attention.py), for forwards with q8 activations."""

import pytest
import torch
import torch.nn.functional as F

from codespec.forward.kernels import prompt_attention
from codespec.forward import Rows, forward_path
from tests.tiny import tiny_arch_model
from tests.gguf_files import write_gguf


def bfloat16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def reference(q, keys, values, start):
    """The attention the tiles compute, in float64 from the same bfloat16 roundings of q, k, v and the weights
    (exp(score - max), largest 1), normalised by the sum of the weights before rounding."""
    count, heads, dim = q.shape
    group = heads // keys.shape[0]
    end = start + count
    k = bfloat16(keys[:, :end].float()).repeat_interleave(group, 0)  # [heads, end, dim]
    v = bfloat16(values[:, :end].float()).repeat_interleave(group, 0)
    scores = torch.einsum("chd,hkd->hck", bfloat16(q), k)
    hidden = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    out = torch.einsum("hck,hkd->chd", bfloat16(weights.float()), v) / weights.sum(-1).T[..., None]
    return out.reshape(count, heads * dim)


def pytorch(q, keys, values, start):
    count = q.shape[0]
    end = start + count
    hidden = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
    mask = torch.zeros(count, end).masked_fill(hidden, float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None, :, :end].float(),
                                         values[None, :, :end].float(), attn_mask=mask, scale=1.0, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(count, -1)


def attend(q, keys, values, start):
    """prompt_attention.attend for a cache that already holds the chunk's keys and values (written again)."""
    rows = slice(start, start + q.shape[0])
    k, v = keys[:, rows].transpose(0, 1).float(), values[:, rows].transpose(0, 1).float()
    return prompt_attention.attend(q, k, v, keys, values, start)


def inputs(start, count, heads, kv_heads, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(count, heads, dim, generator=generator) * 0.2
    keys = (torch.randn(kv_heads, start + count + 5, dim, generator=generator) * 1.5).to(dtype)
    values = torch.randn(kv_heads, start + count + 5, dim, generator=generator).to(dtype)
    return q, keys, values


@pytest.mark.needs_kernels("prompt attention")
@pytest.mark.parametrize("start, count, heads, kv_heads, dim, dtype", [
    (0, 40, 9, 3, 64, torch.float16), (0, 128, 9, 3, 64, torch.float16), (300, 128, 9, 3, 64, torch.float16),
    (17, 33, 4, 2, 16, torch.float32), (100, 1, 4, 4, 32, torch.float32), (1000, 24, 8, 1, 64, torch.float16)])
def test_the_tiles_compute_attention_over_bfloat16_roundings(start, count, heads, kv_heads, dim, dtype):
    q, keys, values = inputs(start, count, heads, kv_heads, dim, dtype)
    got = attend(q, keys, values, start)
    assert got.shape == (count, heads * dim) and got.dtype == torch.float32
    expected = reference(q, keys, values, start)
    assert (got.double() - expected).abs().max() < 2e-3 * expected.abs().max()  # a weight may round the other way
    exact = pytorch(q, keys, values, start)
    assert (got - exact).abs().max() < 2e-2 * exact.abs().max()  # bfloat16's 8 bits, not other numbers


@pytest.mark.needs_kernels("prompt attention")
def test_a_row_gets_the_same_bits_in_any_chunk():
    """Each row sums over its own keys in one order: the prompt's split into chunks does not change it."""
    q, keys, values = inputs(20, 60, 9, 3, 64, torch.float16, seed=1)
    whole = attend(q, keys, values, 20)
    later = attend(q[20:], keys, values, 40)  # rows 40..79 as a chunk of their own
    alone = attend(q[33:34], keys, values, 53)
    assert torch.equal(later, whole[20:]) and torch.equal(alone, whole[33:34])


def q8_forward(tmp_path, model, activations="q8"):
    """The forward these tests check, its bfloat16 tiles compiled first: on a CPU without AVX512-BF16 that is a
    MissingInstructions naming it (the forward itself would attend in PyTorch there, and check nothing here)."""
    lean = forward_path(model, gguf=write_gguf(tmp_path / "tiny.gguf", model, permute=True), activations=activations)
    if activations == "q8":
        prompt_attention.kernels(lean.head_dim)
    return lean


@pytest.mark.parametrize("activations", [
    pytest.param("q8", marks=pytest.mark.needs_kernels("q8 block tiles", "prompt attention")), "float32"])
def test_prompt_chunks_with_q8_activations_attend_in_the_tiles(tmp_path, monkeypatch, activations):
    """q8 activations: chunks of more than layers.FEW_ROWS prompt rows attend in the bfloat16 tiles (where the CPU
    has them: monkeypatched away, PyTorch's attention); float32 activations keep PyTorch's float32 attention. The
    tiles leave their layouts on the cache."""
    lean = q8_forward(tmp_path, tiny_arch_model("llama", dtype=torch.float32), activations)
    ids = list(range(3, 43))
    cache = lean.new_cache()
    logits = lean.batch([Rows(cache, ids, len(ids), prompt=True)])[0]
    assert cache.laid.laid == [40, 40] if activations == "q8" else cache.laid is None  # (2 layers)
    monkeypatch.setattr(prompt_attention, "available", lambda: False)
    cache = lean.new_cache()
    fallback = lean.batch([Rows(cache, ids, len(ids), prompt=True)])[0]
    assert cache.laid is None
    assert (logits - fallback).abs().max() < 0.05 * fallback.abs().max()


@pytest.mark.needs_kernels("q8 block tiles", "prompt attention")
def test_prompt_chunks_batched_together_get_the_bits_they_get_alone(tmp_path):
    """A prompt chunk alone runs its layers in one numba call (layers._prompt_layers); with another sequence in the
    forward, layer by layer from Python (layers._attend_apart): the same numbers either way."""
    lean = q8_forward(tmp_path, tiny_arch_model("llama", dtype=torch.float32))
    first, second = list(range(3, 43)), [(7 * i) % 90 + 3 for i in range(30)]
    alone = [lean.batch([Rows(lean.new_cache(), ids, len(ids), prompt=True)])[0] for ids in (first, second)]
    together = lean.batch([Rows(lean.new_cache(), ids, len(ids), prompt=True) for ids in (first, second)])
    assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])


@pytest.mark.needs_kernels("q8 block tiles", "prompt attention")
def test_a_prompts_split_into_chunks_does_not_change_its_logits(tmp_path):
    """With q8 activations every row's projections and prompt attention are its own: one chunk of 1,200 rows (whose
    MLP runs in slices of rows, layers.MLP_BYTES) and three of 400 give the same bits."""
    from codespec.forward.kernels import layers

    model = tiny_arch_model("llama", dtype=torch.float32, context=2048)
    lean = q8_forward(tmp_path, model)
    outputs = 2 * model.config.intermediate_size
    assert layers._mlp_rows(1200, outputs) < 1200 and layers._mlp_rows(1200, outputs) % 8 == 0
    assert layers._mlp_rows(16, outputs) == 16
    ids = [(7 * i) % 300 + 3 for i in range(1200)]
    whole = lean.batch([Rows(lean.new_cache(), ids, 1200, prompt=True)])[0]
    cache = lean.new_cache()
    parts = [lean.batch([Rows(cache, ids[i : i + 400], 400, prompt=True)])[0] for i in range(0, 1200, 400)]
    assert torch.equal(whole, torch.cat(parts))


@pytest.mark.needs_kernels("q8 block tiles", "prompt attention")
def test_kept_layouts_follow_crops_and_moves(tmp_path):
    """A cache keeps its keys laid out for the tiles between prompt chunks (prompt_attention.Laid): after a crop and
    another text, and after keys moved into it, a chunk gives the bits that a fresh cache holding the same keys
    gives; decoding drops the layouts."""
    lean = q8_forward(tmp_path, tiny_arch_model("llama", dtype=torch.float32, context=2048))

    def chunks(cache, ids, size=40):
        return torch.cat([lean.batch([Rows(cache, ids[i : i + size], len(ids[i : i + size]), prompt=True)])[0]
                          for i in range(0, len(ids), size)])

    first, other, last = [(5 * i) % 200 + 3 for i in range(120)], [(11 * i) % 200 + 3 for i in range(60)], \
        [(3 * i) % 200 + 3 for i in range(80)]
    cache = lean.new_cache()
    chunks(cache, first)
    assert cache.laid is not None and cache.laid.laid == [120, 120]
    cache.crop(50)  # the history was rewritten from position 50
    assert cache.laid.laid == [50, 50]
    got = chunks(cache, other + last)
    fresh = lean.new_cache()
    assert torch.equal(got, chunks(fresh, first[:50] + other + last)[50:])

    donor = lean.new_cache()
    chunks(donor, other)
    lean.move(donor, 10, 60, 40, into=cache)  # 40 keys from another cache into positions 60..99
    assert cache.laid.laid == [60, 60]
    cache.length = 100
    moved = chunks(cache, last)
    twin = lean.new_cache()  # the same keys, laid out from scratch
    twin.keys.copy_(cache.keys), twin.values.copy_(cache.values)
    twin.length = 100
    assert torch.equal(moved, chunks(twin, last))

    lean.batch([Rows(cache, [7], 1)])  # decoding
    assert cache.laid is None
