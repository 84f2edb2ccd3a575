"""Linear layers that read bfloat16-valued float32 weights as 16 bits, for forwards over few rows on CPUs.

A forward over a few tokens reads every weight once and does little with it, so on a CPU it costs what reading
the weights costs. The default model's checkpoint is stored in bfloat16 (so are most published models), and its
float32 weights are those bfloat16 values widened: their low 16 bits are zero. Here each such matrix is also
kept as its high 16 bits only, half the bytes, and the kernel widens them back on the fly (a shift or a mask; no
rounding), so it multiplies by exactly the weights the float32 path uses.

In a batch, four rows at a time share each widened weight; the rest, and a one-token decode, are summed one by one
in another order. So a verify forward's logits can differ from decoding alone in the last bits, as they can with
oneDNN's GEMM (which forwards over more than `FEW_ROWS` use); the bench checks that outputs stay identical.

numba, like attention.py, registered as the torch operator `codespec::linear16` for the TorchScript layer loop.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from numba import prange
from numba.core import types
from numba.extending import intrinsic

from . import attention

FEW_ROWS = 12  # forwards over at most this many rows read the 16-bit copies (measured: beyond, oneDNN's GEMM wins)


@intrinsic
def _float_bits(typingctx, bits):
    """The float32 whose bits are `bits` (uint32)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.uint32), codegen


@numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def _linear(even, odd, weight, out):
    """out[r, n] = x[r] . w[n], where x's even and odd columns are given apart (even, odd [rows, K/2] float32)
    and each weight element holds two: weight [N, K/2] uint32, the low 16 bits a bfloat16 weight of an even
    column, the high 16 bits the next one. Widening one is a shift, the other a mask."""
    count, half = weight.shape
    rows = even.shape[0]
    for n in prange(count):
        w = weight[n]
        r = 0
        while r + 4 <= rows:  # four rows share each widened pair
            e0, e1, e2, e3 = even[r], even[r + 1], even[r + 2], even[r + 3]
            o0, o1, o2, o3 = odd[r], odd[r + 1], odd[r + 2], odd[r + 3]
            t0 = t1 = t2 = t3 = np.float32(0.0)
            for j in range(half):
                pair = w[j]
                low, high = _float_bits(pair << 16), _float_bits(pair & 0xFFFF0000)
                t0 += low * e0[j] + high * o0[j]
                t1 += low * e1[j] + high * o1[j]
                t2 += low * e2[j] + high * o2[j]
                t3 += low * e3[j] + high * o3[j]
            out[r, n], out[r + 1, n], out[r + 2, n], out[r + 3, n] = t0, t1, t2, t3
            r += 4
        while r < rows:  # the rest one by one (decoding: the whole forward)
            e, o = even[r], odd[r]
            total = np.float32(0.0)
            for j in range(half):
                pair = w[j]
                total += _float_bits(pair << 16) * e[j] + _float_bits(pair & 0xFFFF0000) * o[j]
            out[r, n] = total
            r += 1


def exact(weight: torch.Tensor) -> bool:
    """True when `weight` (2-D float32 on the CPU, an even number of columns) holds only bfloat16 values, so 16
    bits of each keep all of it."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and not bool((weight.contiguous().view(torch.int32) & 0xFFFF).any()))


def high_halves(weight: torch.Tensor) -> torch.Tensor:
    """The 16 high bits of each float32 weight (its bfloat16 value), two to an int32: [N, K/2]."""
    return (weight.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.int32)


def linear16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, K] float32 times the transposed weight given by its high halves (high_halves): [rows, N]."""
    attention.match_threads()
    even, odd = x[:, 0::2].contiguous(), x[:, 1::2].contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    _linear(even.numpy(), odd.numpy(), weight.numpy().view(np.uint32), out.numpy())
    return out


_LIBRARY = torch.library.Library("codespec", "FRAGMENT")
_LIBRARY.define("linear16(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("linear16", linear16, "CPU")


@functools.cache
def ready() -> bool:
    """Compile (or load from numba's on-disk cache) the kernel and run it once; True where it pays: numba has an
    OpenMP (or TBB) pool, as for attention.py."""
    linear16(torch.ones(1, 8), high_halves(torch.ones(2, 8)))
    return attention.ready()
