"""Projections from the 16 high bits of bfloat16-valued float32 weights: the same weights, half the bytes."""

import pytest
import torch

from codespec import linear16
from codespec.forward import LeanLlama, TransformersForward
from tests.tiny import tiny_arch_model


def widened(halves: torch.Tensor) -> torch.Tensor:
    return (halves.to(torch.int32) << 16).view(torch.float32)


def test_only_bfloat16_valued_float32_weights_are_kept_as_16_bits_and_nothing_is_lost():
    weight = torch.randn(96, 64).bfloat16().float()
    assert linear16.exact(weight)
    halves = linear16.high_halves(weight).view(torch.int16)
    assert torch.equal(widened(halves), weight)  # negative values and signs included
    assert not linear16.exact(torch.randn(96, 64))  # float32 values need all 32 bits
    assert not linear16.exact(weight.double())
    assert not linear16.exact(weight[:, :63])  # two weights to an int32


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 12, 13])
def test_the_kernel_multiplies_by_the_widened_weights(rows):
    torch.manual_seed(rows)
    weight = torch.randn(200, 576).bfloat16().float()
    x = torch.randn(rows, 576)
    out = torch.ops.codespec.linear16(x, linear16.high_halves(weight))
    assert out.shape == (rows, 200)
    assert (out - x.double() @ weight.double().T).abs().max().item() < 1e-4


def test_a_row_gets_the_same_bits_wherever_it_is_summed_the_same_way():
    """Rows in whole blocks of four share each widened weight; the rest (all of a one-token decode) are summed one
    by one, in another order: the same row differs between the two by float rounding only."""
    torch.manual_seed(0)
    halves = linear16.high_halves(torch.randn(300, 128).bfloat16().float())
    x = torch.randn(11, 128)
    together = torch.ops.codespec.linear16(x, halves)  # rows 0-7 in two blocks, 8-10 one by one
    alone = torch.cat([torch.ops.codespec.linear16(x[i : i + 1], halves) for i in range(11)])
    assert torch.equal(alone[8:], together[8:])
    assert torch.equal(torch.ops.codespec.linear16(x[4:8], halves), together[4:8])
    assert torch.equal(torch.ops.codespec.linear16(x[8:], halves), together[8:])
    assert (alone - together).abs().max().item() < 1e-4
    transposed = x.T.contiguous().T  # a strided input is read as the same numbers
    assert torch.equal(torch.ops.codespec.linear16(transposed, halves), together)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_bfloat16_valued_model_reads_16_bit_weights_for_few_rows_and_gets_the_32_bit_results(kind, monkeypatch):
    model = tiny_arch_model(kind, dtype=torch.bfloat16).float()  # float32 weights holding bfloat16 values
    lean, plain = LeanLlama(model), LeanLlama(model)
    assert linear16.ready()  # numba's OpenMP pool is on this machine (Debian's libgomp1)
    assert len(lean.narrow) == 4 * model.config.num_hidden_layers + 1  # every projection, and the output layer
    plain.narrow = []  # the same forward with oneDNN's float32 GEMM throughout
    calls = []
    kernel = linear16._linear
    monkeypatch.setattr(linear16, "_linear", lambda x, *rest: calls.append(x.shape[0]) or kernel(x, *rest))
    cache, plain_cache = lean.new_cache(), plain.new_cache()
    prompt = list(range(3, 40))  # more rows than linear16.FEW_ROWS: oneDNN's GEMM for both
    assert torch.equal(lean(cache, prompt, 2), plain(plain_cache, prompt, 2))
    assert calls == []
    for ids in ([7], [8, 9, 10, 11, 12]):  # decoding and a verify forward: the 16-bit copies
        got, want = lean(cache, ids, len(ids)), plain(plain_cache, ids, len(ids))
        assert (got - want).abs().max().item() < 1e-4
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert sorted(set(calls)) == [1, 5] and len(calls) == 2 * (4 * model.config.num_hidden_layers + 1)
    reference = TransformersForward(model)  # and transformers agrees to float32 rounding
    assert (lean(cache, [13], 1) - reference(reference.new_cache(), prompt + [7, 8, 9, 10, 11, 12, 13], 1)).abs().max() < 1e-2


def test_models_with_full_float32_weights_keep_the_32_bit_path():
    assert LeanLlama(tiny_arch_model("llama", dtype=torch.float32)).narrow == []
    assert LeanLlama(tiny_arch_model("llama")).narrow == []  # float64
