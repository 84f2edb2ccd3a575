"""Linear layers that read bfloat16-valued float32 weights as 16 bits, for forwards over few rows on CPUs.

A forward over a few tokens reads every weight once and does little with it, so on a CPU it costs what reading
the weights costs. The default model's checkpoint is stored in bfloat16 (so are most published models), and its
float32 weights are those bfloat16 values widened: their low 16 bits are zero. Here each such matrix is also
kept as its high 16 bits only, half the bytes, and the kernel widens them back on the fly (a 16-bit shift; no
rounding), so it multiplies by exactly the weights the float32 path uses. Measured on 2 AVX2 cores, one forward
of the default model at 1 token: 27.6 -> 19.3 ms (see `FEW_ROWS`, and the table in the README).

The kernel computes every row alone, always in blocks of `BLOCK` rows with the same instructions (a short batch
is padded with zero rows), so a row's result does not depend on which other rows share the forward: decoding a
token alone and verifying it inside a draft give the same numbers, bit for bit.

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
BLOCK = 4  # rows computed together, sharing each widened weight


@intrinsic
def _float_bits(typingctx, bits):
    """The float32 whose bits are `bits` (uint32)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return types.float32(types.uint32), codegen


@numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def _linear(x, weight, out):
    """out[r, n] = x[r] . weight[n] for x [rows, K] float32 (rows a multiple of BLOCK), weight [N, K] the high
    halves (uint16) of bfloat16-valued float32 weights, out [rows, N]."""
    count, size = weight.shape
    for n in prange(count):
        w = weight[n]
        for r in range(0, x.shape[0], 4):
            x0, x1, x2, x3 = x[r], x[r + 1], x[r + 2], x[r + 3]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for i in range(size):
                v = _float_bits(np.uint32(w[i]) << 16)
                a0 += v * x0[i]
                a1 += v * x1[i]
                a2 += v * x2[i]
                a3 += v * x3[i]
            out[r, n], out[r + 1, n], out[r + 2, n], out[r + 3, n] = a0, a1, a2, a3


def exact(weight: torch.Tensor) -> bool:
    """True when `weight` (float32, on the CPU) holds only bfloat16 values, so 16 bits of each keep all of it."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and not bool((weight.view(torch.int32) & 0xFFFF).any()))


def high_halves(weight: torch.Tensor) -> torch.Tensor:
    """The 16 high bits of each float32 weight, [N, K] int16 (the bfloat16 value, as bits)."""
    return (weight.contiguous().view(torch.int32) >> 16).to(torch.int16)


def linear16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, K] float32 times the transposed weight given by its high halves [N, K]: [rows, N]."""
    attention.match_threads()
    rows = x.shape[0]
    padded = -(-rows // BLOCK) * BLOCK
    if padded != rows or not x.is_contiguous():
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])]) if padded != rows else x.contiguous()
    out = torch.empty((padded, weight.shape[0]), dtype=torch.float32)
    _linear(x.numpy(), weight.numpy().view(np.uint16), out.numpy())
    return out[:rows]


_LIBRARY = torch.library.Library("codespec", "FRAGMENT")
_LIBRARY.define("linear16(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("linear16", linear16, "CPU")


@functools.cache
def ready() -> bool:
    """Compile (or load from numba's on-disk cache) the kernel and run it once; True where it pays: numba has an
    OpenMP (or TBB) pool, as for attention.py."""
    weight = high_halves(torch.ones(2, 8))
    linear16(torch.ones(1, 8), weight)
    return attention.ready()
