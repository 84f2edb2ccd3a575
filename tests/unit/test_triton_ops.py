"""The Triton kernels of the graph-safe forward (codespec/forward/kernels/triton_ops.py), run in Triton's
interpreter on CPU tensors: each operation against float64 arithmetic written out here, and the batch invariance
that keeps speculation lossless (a row's bits alone, stacked with other rows, or with other sessions).

The interpreter's dot products are numpy's, so these tests check the kernels' indexing, masking, split arithmetic
and that no tile or loop bound depends on the other rows; the GPU's own rounding is checked on CUDA (bfloat16,
which the interpreter's tl.dot gets wrong, is left to it: float32 and float16 here)."""

import os
import sys

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import codespec.forward.kernels as kernels_package

# The kernels are decorated for the interpreter only where TRITON_INTERPRET is set when their module is imported.
# Set here for that import only, and the interpreted module is not left behind (in sys.modules, or as the
# package's attribute): a CUDA run of the suite (graph_ops imports it lazily) gets compiled kernels, and
# torch.compile its own.
MODULE = "codespec.forward.kernels.triton_ops"
_saved_env, _saved_module = os.environ.get("TRITON_INTERPRET"), sys.modules.pop(MODULE, None)
os.environ["TRITON_INTERPRET"] = "1"
try:
    from codespec.forward.kernels import triton_ops
    from codespec.forward.kernels.triton_ops import TritonOps
finally:
    if _saved_env is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved_env
    if _saved_module is None:
        del sys.modules[MODULE], kernels_package.triton_ops
    else:
        sys.modules[MODULE] = kernels_package.triton_ops = _saved_module


@pytest.fixture(autouse=True, scope="module")
def interpreted_library():
    """Triton's own library functions (tl.sum, tl.max, tl.zeros: @jit in triton.language.standard) are decorated
    when triton is first imported, which tests/conftest.py does before this module (through torch._dynamo): as
    compiled functions, which the interpreter cannot call. Interpreted copies stand in for them while these tests
    run (the same copy under both names: the interpreter recognises its reductions by identity), with
    TRITON_INTERPRET set (the library's constexpr functions ask it at call time); both restored afterwards."""
    saved_env, copies, patched = os.environ.get("TRITON_INTERPRET"), {}, []
    os.environ["TRITON_INTERPRET"] = "1"
    for module in (tl.standard, tl):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                copy = copies.setdefault(id(value), InterpretedFunction(value.fn))
                patched.append((module, name, value))
                setattr(module, name, copy)
    yield
    for module, name, value in patched:
        setattr(module, name, value)
    if saved_env is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = saved_env



@pytest.fixture(autouse=True, scope="module")
def dots_a_row_at_a_time():
    """The interpreter's tl.dot is numpy's matmul, whose BLAS (OpenBLAS's Haswell kernels, on an AVX2 host) rounds a
    row's products differently by where the row falls in the tile (124 of 200 rows moved within a 16 x 16 float32
    product changed bits there; not on an AVX-512 host): that would fail the invariance tests below for the BLAS,
    not for the kernels. Here each output is its own sum, in order, of float32 products, whatever rows surround it;
    a GPU's own dots are checked on CUDA."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # (fp8: as the interpreter does)
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        accumulator = d.data.dtype
        products = a.data.astype(accumulator)[..., :, :, None] * b.data.astype(accumulator)[..., None, :, :]
        return TensorHandle(products.sum(axis=-2) + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot
    yield
    InterpreterBuilder.create_dot = original


OPS = TritonOps()
EPS = 1e-6
DTYPES = [torch.float32, torch.float16]
# tolerances against float64, for results rounded to the dtype (float16: 11-bit mantissas, and attention's
# weights rounded to float16 for their product with the values, as on tensor cores)
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def generator(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=generator(seed)).to(dtype)


def test_the_kernels_run_in_the_interpreter():
    # imported before TRITON_INTERPRET was set (another module first), they would be compiled for a GPU instead
    kernels = [value for name, value in vars(triton_ops).items() if name.endswith("_kernel")]
    assert len(kernels) == 6
    assert all(isinstance(kernel, InterpretedFunction) for kernel in kernels)


# ---- the float64 references


def reference_linear(x, weight, bias=None):
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


def reference_norm(x, weight, eps=EPS):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rotary_tables(length, dim):
    """float32 cos and sin [length, dim / 2], as a model's rotary tables."""
    angles = torch.arange(length, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(dim // 2) / (dim // 2))
    return angles.cos().float(), angles.sin().float()


def reference_rotate(qkv, cos, sin, positions, heads, kv_heads, qk_norm):
    """The q and k heads, normed (qk_norm) and turned pair by pair, and the v heads: float64 [M, heads + 2 kv, dim]."""
    rows = qkv.shape[0]
    parts = qkv.double().view(rows, heads + 2 * kv_heads, -1).clone()
    turned = parts[:, : heads + kv_heads].clone()  # (parts is written below)
    if qk_norm is not None:
        turned = reference_norm(turned, qk_norm)
    a, b = turned[..., 0::2], turned[..., 1::2]
    c, s = cos.double()[positions][:, None], sin.double()[positions][:, None]  # [M, 1, dim / 2]
    parts[:, : heads + kv_heads, 0::2] = a * c - b * s
    parts[:, : heads + kv_heads, 1::2] = a * s + b * c
    return parts


def reference_attend(q, keys, values, slots, starts, width):
    """Row by row and head by head: softmax over the keys up to the row's position, times the values."""
    rows, heads, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for row in range(rows):
        session, r = divmod(row, width)
        slot, position = int(slots[session]), int(starts[session]) + r
        for h in range(heads):
            k = keys[slot, h // group, : position + 1].double()
            v = values[slot, h // group, : position + 1].double()
            out[row, h] = torch.softmax(k @ q[row, h].double(), 0) @ v
    return out.view(rows, heads * dim)


# ---- each operation against the references


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(dtype, with_bias):
    # sizes that are no multiple of any tile: masked rows, columns and K steps
    x, weight, bias = randn(37, 80, dtype=dtype), randn(72, 80, dtype=dtype, seed=1), randn(72, dtype=dtype, seed=2)
    out = OPS.linear(x, weight, bias if with_bias else None)
    assert out.shape == (37, 72) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference_linear(x, weight, bias if with_bias else None),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm(dtype):
    x, weight = randn(5, 48, dtype=dtype), randn(48, dtype=dtype, seed=1)
    out = OPS.norm(x, weight, EPS)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference_norm(x, weight), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_norm_returns_the_sum_and_its_norm(dtype):
    x, delta, weight = randn(5, 48, dtype=dtype), randn(5, 48, dtype=dtype, seed=1), randn(48, dtype=dtype, seed=2)
    before = x.clone()
    summed, normed = OPS.add_norm(x, delta, weight, EPS)
    assert torch.equal(x, before)  # new tensors: the input stream is left as it was
    torch.testing.assert_close(summed.double(), x.double() + delta.double(), **TOLERANCE[dtype])
    # the norm of the sum as stored (rounded to the dtype), as a separate add then norm would see it
    torch.testing.assert_close(normed.double(), reference_norm(summed, weight), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = randn(3, 2 * 1100, dtype=dtype)  # F = 1100: two column blocks, the second masked
    gate, up = gate_up.double().chunk(2, dim=-1)
    out = OPS.silu_mul(gate_up)
    assert out.shape == (3, 1100) and out.dtype == dtype
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 2)])  # (6, 2): 10 heads, a padded tile
def test_rotate_and_store(dtype, normed, heads, kv_heads):
    dim, length, slots_count = 16, 64, 4
    # two sessions' rows (slots 3 and 1) at their positions; slots 0 and 2 are not written
    positions, slots = torch.tensor([5, 6, 7, 40, 41]), torch.tensor([3, 3, 3, 1, 1])
    qkv = randn(5, (heads + 2 * kv_heads) * dim, dtype=dtype)
    qk_norm = randn(heads + kv_heads, dim, seed=1).to(dtype) if normed else None
    cos, sin = rotary_tables(length, dim)
    keys, values = randn(slots_count, kv_heads, length, dim, dtype=dtype, seed=2), randn(
        slots_count, kv_heads, length, dim, dtype=dtype, seed=3)
    keys_before, values_before = keys.clone(), values.clone()
    q = OPS.rotate_and_store(qkv, cos, sin, positions, slots, keys, values, heads, kv_heads, qk_norm, EPS)
    want = reference_rotate(qkv, cos, sin, positions, heads, kv_heads, qk_norm)
    assert q.shape == (5, heads, dim) and q.dtype == dtype
    torch.testing.assert_close(q.double(), want[:, :heads], **TOLERANCE[dtype])
    # each row's k and v heads at (its slot, each head, its position) ...
    torch.testing.assert_close(keys[slots, :, positions].double(), want[:, heads : heads + kv_heads],
                               **TOLERANCE[dtype])
    torch.testing.assert_close(values[slots, :, positions].double(), want[:, heads + kv_heads :], **TOLERANCE[dtype])
    # ... and nothing else in the pool changed
    untouched = torch.ones(slots_count, length, dtype=torch.bool)
    untouched[slots, positions] = False
    assert torch.equal(keys.transpose(1, 2)[untouched], keys_before.transpose(1, 2)[untouched])
    assert torch.equal(values.transpose(1, 2)[untouched], values_before.transpose(1, 2)[untouched])
    assert not torch.equal(keys, keys_before) and not torch.equal(values, values_before)


def pool(slots_count, kv_heads, length, dim, dtype=torch.float32, seed=0):
    """A layer's keys and values [slots, kv_heads, length, dim] of random data."""
    return (randn(slots_count, kv_heads, length, dim, dtype=dtype, seed=seed),
            randn(slots_count, kv_heads, length, dim, dtype=dtype, seed=seed + 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, width, split", [(4, 2, 4, 32), (6, 2, 4, 64), (4, 2, 16, None)])
def test_attend(dtype, heads, kv_heads, width, split):
    """Several sessions at different starts (one split, several, the pool's end) in scattered slots; the unused
    slots, and every key past a session's last row, hold NaN: read, they would show in the result."""
    dim, length = 16, 128
    keys, values = pool(5, kv_heads, length, dim, dtype)
    slots, starts = torch.tensor([3, 0, 1]), torch.tensor([0, 70, length - width])
    for slot, start in zip(slots.tolist(), starts.tolist()):
        keys[slot, :, start + width :] = float("nan")
        values[slot, :, start + width :] = float("nan")
    for unused in (2, 4):
        keys[unused], values[unused] = float("nan"), float("nan")
    q = randn(3 * width, heads, dim, dtype=dtype, seed=5) * dim**-0.5
    out = OPS.attend(q, keys, values, slots, starts, width, split=split)
    assert out.shape == (3 * width, heads * dim) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference_attend(q, keys, values, slots, starts, width),
                               **TOLERANCE[dtype])


# ---- batch invariance: bit for bit


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_linear_rows_bits_do_not_depend_on_the_other_rows(dtype):
    x, weight, bias = randn(64, 80, dtype=dtype), randn(72, 80, dtype=dtype, seed=1), randn(72, dtype=dtype, seed=2)
    alone = OPS.linear(x[:16], weight, bias)
    for blocks in (2, 3, 4):
        stacked = OPS.linear(x[: 16 * blocks], weight, bias)
        assert torch.equal(stacked[:16], alone)
        # and the last block's rows are the bits they get alone
        assert torch.equal(stacked[-16:], OPS.linear(x[16 * (blocks - 1) : 16 * blocks], weight, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sessions_attention_is_the_same_bits_alone_and_stacked(dtype):
    """One session alone (slot 0 of a pool) against the same session second of three (slot 2 of another pool whose
    other slots, and the other sessions' queries and starts, differ)."""
    heads, kv_heads, dim, length, width = 4, 2, 16, 128, 4
    keys, values = pool(1, kv_heads, length, dim, dtype)
    q = randn(width, heads, dim, dtype=dtype, seed=2) * dim**-0.5
    alone = OPS.attend(q, keys, values, torch.tensor([0]), torch.tensor([90]), width, split=32)
    others_keys, others_values = pool(4, kv_heads, length, dim, dtype, seed=3)
    others_keys[2], others_values[2] = keys[0], values[0]
    stacked_q = torch.cat([randn(width, heads, dim, dtype=dtype, seed=4), q, randn(width, heads, dim, dtype=dtype,
                                                                                   seed=5)])
    stacked = OPS.attend(stacked_q, others_keys, others_values, torch.tensor([1, 2, 3]), torch.tensor([7, 90, 120]),
                         width, split=32)
    assert torch.equal(stacked[width : 2 * width], alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_attention_does_not_depend_on_rows_that_reach_further(dtype):
    """A row at position 150, past four splits of 32 keys: as its session's last row, against the same row first
    in a session whose other rows reach into the next split (their keys written differently), beside a session
    reaching to the pool's end."""
    heads, kv_heads, dim, length, width, position = 4, 2, 16, 192, 4, 150
    keys, values = pool(2, kv_heads, length, dim, dtype)
    q = randn(2 * width, heads, dim, dtype=dtype, seed=2) * dim**-0.5
    last = OPS.attend(q[:width], keys, values, torch.tensor([0]), torch.tensor([position - width + 1]), width,
                      split=32)[width - 1]
    further_keys, further_values = keys.clone(), values.clone()
    further_keys[0, :, position + 1 :] = randn(kv_heads, length - position - 1, dim, dtype=dtype, seed=3)
    further_values[0, :, position + 1 :] = randn(kv_heads, length - position - 1, dim, dtype=dtype, seed=4)
    stacked_q = torch.cat([q[width - 1 : width], q[width + 1 :], randn(width, heads, dim, dtype=dtype, seed=5)])
    first = OPS.attend(stacked_q, further_keys, further_values, torch.tensor([0, 1]),
                       torch.tensor([position, length - width]), width, split=32)[0]
    assert torch.equal(first, last)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_attends_to_nothing_past_its_own_position(dtype):
    heads, kv_heads, dim, length, width, start = 4, 2, 16, 96, 4, 60
    keys, values = pool(1, kv_heads, length, dim, dtype)
    q = randn(width, heads, dim, dtype=dtype, seed=2) * dim**-0.5
    before = OPS.attend(q, keys, values, torch.tensor([0]), torch.tensor([start]), width, split=32)
    # the keys and values past row 1's position: rows 0 and 1 keep their bits, rows 2 and 3 see the change
    keys[0, :, start + 2 :] = randn(kv_heads, length - start - 2, dim, dtype=dtype, seed=3)
    values[0, :, start + 2 :] = randn(kv_heads, length - start - 2, dim, dtype=dtype, seed=4)
    after = OPS.attend(q, keys, values, torch.tensor([0]), torch.tensor([start]), width, split=32)
    assert torch.equal(after[:2], before[:2])
    assert not torch.equal(after[2], before[2]) and not torch.equal(after[3], before[3])


# ---- the whole graph-safe forward on these kernels


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_the_graph_safe_forward_on_the_triton_kernels_computes_the_pytorch_ops_logits_stacked_or_alone(kind):
    """TritonOps in graphs.GraphLlama's forward (the interface graph_ops.TorchOps declares): a prompt chunk at its own
    length, then three sessions' drafts stacked in one forward, give PyTorch's logits, and each session's the same
    bits as in a forward of its own."""
    from codespec.forward import Rows, forward_path
    from tests.tiny import tiny_arch_model

    model = tiny_arch_model(kind, dtype=torch.float32, context=64)
    pytorch, fused = forward_path(model, graphs=True), forward_path(model, graphs=True)
    fused.ops = OPS
    assert pytorch.ops.name == "torch" and fused.ops.name == "triton"
    prompts = [list(range(3 + i, 30 + 5 * i)) for i in range(3)]
    drafts = [[5, 6, 7], [9], list(range(40, 56))]
    results = {}
    for path in (pytorch, fused):
        caches, alone = [path.new_cache() for _ in prompts], [path.new_cache() for _ in prompts]
        for cache, prompt in zip(caches + alone, prompts + prompts):
            path.batch([Rows(cache, prompt, 1, prompt=True)])
        stacked = path.batch([Rows(cache, ids, len(ids)) for cache, ids in zip(caches, drafts)])
        for cache, ids, got in zip(alone, drafts, stacked):
            assert torch.equal(path(cache, ids, len(ids)), got)
        results[path.ops.name] = stacked
    for theirs, ours in zip(results["torch"], results["triton"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
