"""The numba forward over few rows: the same weights read as 16 bits, the same logits as the PyTorch path."""

import numpy as np
import pytest
import torch

from codespec.forward.kernels import attention, layers
from codespec.forward import LeanLlama, Rows, TransformersForward
from tests.tiny import tiny_arch_model


def widened(halves: np.ndarray) -> torch.Tensor:
    pairs = torch.from_numpy(halves.view(np.int16).astype(np.int32))
    return (pairs << 16).view(torch.float32)


def bfloat16_valued(kind: str):
    return tiny_arch_model(kind, dtype=torch.bfloat16).float()  # float32 weights holding bfloat16 values


def test_only_bfloat16_valued_float32_weights_are_kept_as_16_bits_and_nothing_is_lost():
    weight = torch.randn(96, 64).bfloat16().float()
    assert layers.exact(weight)
    halves = layers.high_halves(weight)
    assert halves.shape == (96, 32) and halves.dtype == np.uint32  # two to an element
    assert torch.equal(widened(halves), weight)  # negative values and signs included
    assert not layers.exact(torch.randn(96, 64))  # float32 values need all 32 bits
    assert not layers.exact(weight.double())
    assert not layers.exact(weight[:, :63])  # two weights to a uint32


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 12, 13])
def test_the_projection_multiplies_by_the_widened_weights(rows):
    torch.manual_seed(rows)
    weight = torch.randn(200, 576).bfloat16().float()
    norm = torch.rand(576) + 0.5
    x = torch.randn(rows, 576)
    out = torch.from_numpy(layers._linear(x.numpy(), layers.EMPTY, 1e-5, layers.high_halves(weight)))
    assert out.shape == (rows, 200)
    assert (out - x.double() @ weight.double().T).abs().max().item() < 1e-4
    normed = torch.from_numpy(layers._linear(x.numpy(), norm.numpy(), 1e-5, layers.high_halves(weight)))
    expected = torch.rms_norm(x.double(), [576], norm.double(), 1e-5) @ weight.double().T
    assert (normed - expected).abs().max().item() < 1e-4


def test_rows_in_blocks_of_four_then_two_then_one_are_each_summed_one_way():
    """Rows in whole blocks of four share each widened weight, then two of the rest together, then the last alone
    (all of a one-token decode), each in its own order: the same row differs between them by float rounding only.
    Past 8 rows the columns go in blocks of 16 (300 here: the last block is short), with the same sums."""
    torch.manual_seed(0)
    halves = layers.high_halves(torch.randn(300, 128).bfloat16().float())

    def project(x):
        return layers._linear(x.numpy(), layers.EMPTY, 1e-5, halves)

    x = torch.randn(11, 128)
    together = project(x)  # rows 0-7 in two blocks of four, 8-9 as a pair, 10 alone
    alone = np.concatenate([project(x[i : i + 1]) for i in range(11)])
    assert np.array_equal(alone[10:], together[10:])
    assert np.array_equal(project(x[4:8]), together[4:8])
    assert np.array_equal(project(x[8:10]), together[8:10])
    assert np.array_equal(project(x[8:]), together[8:])
    assert np.abs(alone - together).max() < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_bfloat16_valued_model_runs_few_rows_in_numba_and_gets_the_pytorch_results(kind, monkeypatch):
    model = bfloat16_valued(kind)
    lean, plain = LeanLlama(model, cache_type="f32"), LeanLlama(model, cache_type="f32")  # as transformers keeps it
    assert layers.ready()  # numba's OpenMP pool is on this machine (Debian's libgomp1)
    assert lean.kernel_weights is not None and len(lean.kernel_weights.projections) == 4 * model.config.num_hidden_layers
    plain.kernel_weights = None  # the same forward in PyTorch: oneDNN's GEMM over the float32 weights
    calls = []
    original = layers.forward
    monkeypatch.setattr(layers, "forward", lambda weights, x, *rest: calls.append(x.shape[0]) or
                        original(weights, x, *rest))
    cache, plain_cache = lean.new_cache(), plain.new_cache()
    prompt = list(range(3, 40))  # more rows than layers.FEW_ROWS: PyTorch
    assert torch.equal(lean(cache, prompt, 2), plain(plain_cache, prompt, 2))
    assert calls == []
    for ids in ([7], [8, 9, 10], [11, 12, 13, 14, 15, 16]):  # decoding, a short verify, one past attention's kernel
        got, want = lean(cache, ids, len(ids)), plain(plain_cache, ids, len(ids))
        assert (got - want).abs().max().item() < 1e-4
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert calls == [1, 3, 6]
    for written, expected in ((cache.keys, plain_cache.keys), (cache.values, plain_cache.values)):
        assert (written[:, :, : cache.length] - expected[:, :, : cache.length]).abs().max().item() < 1e-4
    reference = TransformersForward(model)  # and transformers agrees to float32 rounding
    history = prompt + list(range(7, 17))
    assert (lean(cache, [17], 1) - reference(reference.new_cache(), history + [17], 1)).abs().max() < 1e-2


def test_a_batch_mixing_kernel_and_pytorch_attention_gives_each_sequence_its_own_logits(monkeypatch):
    monkeypatch.setattr(attention, "FEW_ROWS", 4)  # so that a prompt chunk short enough for this path goes apart
    model = bfloat16_valued("llama")
    lean, plain = LeanLlama(model), LeanLlama(model)
    plain.kernel_weights = None
    prompts = [list(range(3, 60)), [5, 6, 7], list(range(50, 300))]
    caches, plain_caches = [lean.new_cache() for _ in prompts], [plain.new_cache() for _ in prompts]
    for prompt, cache, plain_cache in zip(prompts, caches, plain_caches):
        lean(cache, prompt, 1)
        plain(plain_cache, prompt, 1)
    fed = [[41], [8, 9, 10, 11, 12, 13], [61, 62]]  # 9 rows: the middle one, a prompt chunk, past attention.FEW_ROWS
    assert sum(map(len, fed)) <= layers.FEW_ROWS and max(map(len, fed)) > attention.FEW_ROWS
    batched = lean.batch([Rows(cache, ids, len(ids), prompt=len(ids) > 4) for cache, ids in zip(caches, fed)])
    for cache, plain_cache, ids, got in zip(caches, plain_caches, fed, batched):
        want = plain(plain_cache, ids, len(ids))
        assert (got - want).abs().max().item() < 1e-4
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert cache.length == plain_cache.length


def test_models_with_full_float32_weights_keep_the_pytorch_path():
    assert LeanLlama(tiny_arch_model("llama", dtype=torch.float32)).kernel_weights is None
    assert LeanLlama(tiny_arch_model("llama")).kernel_weights is None  # float64


def test_the_mlp_gate_runs_16_lanes_at_a_time_within_a_few_units_in_the_last_place():
    """layers.silu_mul: silu(gate) * up in place, with its own vector exp (Cephes' expf), over the range a model's
    gates take and far past it (exp clamped at +-88: no inf, no NaN)."""
    import ctypes


    silu_mul = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(layers.silu_mul())
    rng = np.random.default_rng(0)
    gate = np.concatenate([np.linspace(-200, 200, 4000), rng.standard_normal(4000) * 4]).astype(np.float32)
    up = rng.standard_normal(8000).astype(np.float32)
    row = np.concatenate([gate, up])
    silu_mul(row.ctypes.data, 8000)
    assert np.array_equal(row[8000:], up)  # up is read, not written
    exact = gate.astype(np.float64) / (1 + np.exp(-gate.astype(np.float64))) * up
    assert np.all(np.isfinite(row))
    assert np.all(np.abs(row[:8000] - exact) <= 4e-6 * np.abs(exact) + 1e-30)
