"""The lean forward over few rows on CPUs, in numba: weights read as 16 bits, a handful of calls per layer.

Decoding and short verifies (a few tokens for each of one or several sessions) cost what reading the weights
costs, plus whatever runs around the matrix products. Two things shrink here:

- **Bytes.** The default model's checkpoint is stored in bfloat16 (so are most published models), so its
  float32 weights are bfloat16 values widened: their low 16 bits are zero. Each projection is also kept as its
  high 16 bits, two to an int32, half the bytes; the kernel widens them back (a shift, or a mask) as it reads,
  so it multiplies by exactly the weights the float32 path uses, with float32 sums.
- **Calls.** PyTorch runs a layer as ~20 small kernels, each a dispatch and a thread-pool wake-up (about 8 ms
  of a 30 ms forward here). Here a layer is four numba calls: norm, the q/k/v projection and rotary embedding in
  one; attention against the caches (attention.py's kernels, which also write the new keys and values, and its
  softmax); the output projection, norm, MLP and both residual adds in the last. When every sequence attends in
  those kernels, the layer loop itself runs in numba too (`_layers`): the Python loop's calls and array views
  cost ~1.5 ms of a 7.5 ms one-token forward (measured back to back, 17-20% at one row, 4-14% at four, 5% for
  8 sessions of one row each).

Rows are summed four at a time where a batch has four (each widened weight serves all four), then two of the
rest together, the last alone: a verify forward's logits may differ from decoding alone in the last bits, as
they may with oneDNN's GEMM (which forwards over more than `FEW_ROWS` rows use); the bench checks that outputs
stay identical. The q and k heads go to the attention kernel as a contiguous copy: as a strided view of the
q/k/v projection, numba compiles the kernel's dot products unvectorised (measured: 4 rows at 2,500 cached
tokens, scores 21 -> 6 ms per forward).
Measured on 2 AVX2 cores, default model: see the forward-cost table in docs/benchmarks.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numba
import numpy as np
import torch
from numba import prange
from numba.core import types
from numba.extending import overload

from . import attention, attention_tiles, block_tiles, capabilities, prompt_attention, q8_tiles
from .attention import _float_bits
from .ir import EXP_DECLARATIONS, exp_ir
from .native import call, compile_ir

FEW_ROWS = 16  # forwards over at most this many rows come here (measured: beyond, oneDNN's GEMM over float32 wins)
EMPTY = np.zeros(0, dtype=np.float32)  # no bias, no norm
NO_QK_NORM = np.zeros((0, 0), dtype=np.float32)  # no per-head q/k norms (all but Qwen3)
L1_ROWS = 8  # up to this many rows, a projection's inputs stay in L1 while a thread runs over output columns
OUTPUTS = 16  # past L1_ROWS, a thread takes blocks of this many output columns and runs each block of rows
# over their weights while they sit in L2 (measured: 16 rows 63 -> 50 ms a forward)


@numba.njit(inline="always", fastmath=True, cache=True, boundscheck=False)
def _project_four(w, even, odd, out, n, r):
    """out[r..r+3, n] = x[r..r+3] . w, where x's even and odd columns come apart (even, odd [rows, K/2]) and w
    [K/2] (uint32) holds two bfloat16 weights per element, an even column's in the low 16 bits: four rows share
    each widened pair."""
    e0, e1, e2, e3 = even[r], even[r + 1], even[r + 2], even[r + 3]
    o0, o1, o2, o3 = odd[r], odd[r + 1], odd[r + 2], odd[r + 3]
    t0 = t1 = t2 = t3 = np.float32(0.0)
    for j in range(w.shape[0]):
        pair = w[j]
        low, high = _float_bits(pair << 16), _float_bits(pair & 0xFFFF0000)
        t0 += low * e0[j] + high * o0[j]
        t1 += low * e1[j] + high * o1[j]
        t2 += low * e2[j] + high * o2[j]
        t3 += low * e3[j] + high * o3[j]
    out[r, n], out[r + 1, n], out[r + 2, n], out[r + 3, n] = t0, t1, t2, t3


@numba.njit(inline="always", fastmath=True, cache=True, boundscheck=False)
def _project_two(w, even, odd, out, n, r):
    """out[r..r+1, n] as _project_four, for two rows."""
    e0, e1, o0, o1 = even[r], even[r + 1], odd[r], odd[r + 1]
    t0 = t1 = np.float32(0.0)
    for j in range(w.shape[0]):
        pair = w[j]
        low, high = _float_bits(pair << 16), _float_bits(pair & 0xFFFF0000)
        t0 += low * e0[j] + high * o0[j]
        t1 += low * e1[j] + high * o1[j]
    out[r, n], out[r + 1, n] = t0, t1


@numba.njit(inline="always", fastmath=True, cache=True, boundscheck=False)
def _project_one(w, even, odd, out, n, r):
    """out[r, n] as _project_four, for one row (decoding: the whole forward)."""
    e, o = even[r], odd[r]
    total = np.float32(0.0)
    for j in range(w.shape[0]):
        pair = w[j]
        total += _float_bits(pair << 16) * e[j] + _float_bits(pair & 0xFFFF0000) * o[j]
    out[r, n] = total


@numba.njit(inline="always", fastmath=True, cache=True, boundscheck=False)
def _split(x, norm, eps):
    """x's even and odd columns apart, each row RMS-normalised and times `norm` first when norm has entries."""
    normed = block_tiles.normed(x, norm, eps)
    return np.ascontiguousarray(normed[:, 0::2]), np.ascontiguousarray(normed[:, 1::2])


@numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def _linear(x, norm, eps, weight):
    """rms_norm(x) (when norm has entries, else x) times the transposed 16-bit weight [N, K/2]: [rows, N]."""
    even, odd = _split(x, norm, eps)
    rows, size = x.shape[0], weight.shape[0]
    out = np.empty((rows, size), dtype=np.float32)
    outputs = OUTPUTS if rows > L1_ROWS else 1
    for block in prange((size + outputs - 1) // outputs):
        first, last = block * outputs, min(size, block * outputs + outputs)
        r = 0
        while r + 4 <= rows:  # blocks of four rows, each over this block's weights (which stay in L2)
            for n in range(first, last):
                _project_four(weight[n], even, odd, out, n, r)
            r += 4
        if r + 2 <= rows:  # two of the rest together
            for n in range(first, last):
                _project_two(weight[n], even, odd, out, n, r)
            r += 2
        if r < rows:  # the last one alone
            for n in range(first, last):
                _project_one(weight[n], even, odd, out, n, r)
    return out


def _project(x, norm, eps, weight):
    """rms_norm(x) (when norm has entries, else x) times the weight: 16 bits in an array (_linear), or a GGUF's
    blocks (block_tiles.linear's tuple, or q8_tiles.linear's: five entries)."""


@overload(_project, jit_options={"cache": True, "fastmath": False})
def _project_by_format(x, norm, eps, weight):
    if isinstance(weight, types.Array):
        return lambda x, norm, eps, weight: _linear(x, norm, eps, weight)
    if len(weight) == 5:
        return lambda x, norm, eps, weight: q8_tiles.linear(block_tiles.normed(x, norm, eps), weight)
    return lambda x, norm, eps, weight: block_tiles.linear(x, norm, eps, weight)


def _outputs(weight):
    """A projection's output columns, in any of _project's formats."""


@overload(_outputs, jit_options={"cache": True, "fastmath": False})
def _outputs_by_format(weight):
    if isinstance(weight, types.Array):
        return lambda weight: weight.shape[0]
    if len(weight) == 5:
        return lambda weight: weight[3]
    return lambda weight: weight[1].shape[0]


MLP_BYTES = 1_000_000  # the most bytes of an MLP's gate/up output at once: a prompt chunk's MLP runs in slices of rows
# so that it and the copies made of it stay under the mmap threshold (memory.py: 1 MB). A fresh buffer above it is a
# fresh mmap, and its page faults made a 128-row chunk's MLP 52 -> 83 ms in the server


@numba.njit(fastmath=False, cache=True)
def _mlp_rows(rows, outputs):
    """Rows per slice of the MLP: all of them when their gate/up output fits MLP_BYTES, else a multiple of 8 (whole
    tiles of every projection format, so a row's numbers do not depend on the slicing)."""
    fit = MLP_BYTES // (4 * outputs) // 8 * 8
    return rows if rows <= fit else max(8, fit)


@numba.njit(fastmath=False, cache=True)
def _output(x, norm, eps, weight):
    """The output layer (from Python)."""
    return _project(x, norm, eps, weight)


@numba.njit(fastmath=True, cache=True, boundscheck=False)
def _attention_in(x, norm, eps, weight, bias, qk_norm, rotary, rotated):
    """The fused q/k/v projection of rms_norm(x), plus bias when it has entries, each q and k head RMS-normalised
    and times its row of qk_norm when that has rows (Qwen3's), its first `rotated` columns (the q and k heads) then
    turned pair by pair by rotary [rows, dim/2, 2] (cos, sin of each row's position)."""
    qkv = _project(x, norm, eps, weight)
    rows, size = qkv.shape
    if bias.shape[0]:
        for r in range(rows):
            for n in range(size):
                qkv[r, n] += bias[n]
    half = rotary.shape[1]
    if qk_norm.shape[0]:
        dim = 2 * half
        for r in range(rows):
            for h in range(qk_norm.shape[0]):
                total = block_tiles.sum_of_squares(qkv[r, h * dim : (h + 1) * dim])
                inverse = np.float32(1.0) / np.sqrt(total / np.float32(dim) + eps)
                for i in range(dim):
                    qkv[r, h * dim + i] = qkv[r, h * dim + i] * inverse * qk_norm[h, i]
    for r in range(rows):
        for head in range(0, rotated, 2 * half):  # (a loop per head: one over all pairs, p % half, ran 1.6x slower)
            for p in range(half):
                cos, sin = rotary[r, p, 0], rotary[r, p, 1]
                a, b = qkv[r, head + 2 * p], qkv[r, head + 2 * p + 1]
                qkv[r, head + 2 * p] = a * cos - b * sin
                qkv[r, head + 2 * p + 1] = a * sin + b * cos
    return qkv


@numba.njit(fastmath=True, cache=True, boundscheck=False)
def _attention_out_and_mlp(x, attended, o_weight, norm, eps, gate_up_weight, down_weight, silu):
    """x += attended @ W_o.T, then x += down(silu(gate) * up) of rms_norm(x), in place. `silu`: silu_mul's
    address (16 lanes at a time; numba's loop calls expf once per element: 2 ms of a 16-row forward)."""
    x += _project(attended, EMPTY, eps, o_weight)
    step = _mlp_rows(x.shape[0], _outputs(gate_up_weight))
    for first in range(0, x.shape[0], step):  # a prompt chunk's MLP a slice of rows at a time (see MLP_BYTES)
        part = x[first : first + step]
        gate_up = _project(part, norm, eps, gate_up_weight)
        inner = gate_up.shape[1] // 2
        if inner % 16 == 0:
            for r in range(part.shape[0]):
                call(silu, gate_up.ctypes.data + r * gate_up.shape[1] * 4, inner)
        else:
            for r in range(part.shape[0]):
                for i in range(inner):
                    gate = gate_up[r, i]
                    gate_up[r, i] = gate / (np.float32(1.0) + np.exp(-gate)) * gate_up[r, inner + i]
        part += _project(gate_up[:, :inner], EMPTY, eps, down_weight)


SILU_IR = (EXP_DECLARATIONS
           + "define void @silu_mul(ptr noalias %gate, i64 %inner) {\nentry:\n  br label %loop\nloop:\n"
           "  %i = phi i64 [ 0, %entry ], [ %i.next, %loop ]\n"
           "  %gp = getelementptr float, ptr %gate, i64 %i\n  %g = load <16 x float>, ptr %gp, align 4\n"
           "  %ui = add i64 %i, %inner\n  %up = getelementptr float, ptr %gate, i64 %ui\n"
           "  %u = load <16 x float>, ptr %up, align 4\n  %m = fneg <16 x float> %g\n"
           + exp_ir("e", "%m") +
           "  %d = fadd <16 x float> %e, splat (float 1.0)\n  %s = fdiv <16 x float> %g, %d\n"
           "  %o = fmul <16 x float> %s, %u\n  store <16 x float> %o, ptr %gp, align 4\n"
           "  %i.next = add i64 %i, 16\n  %done = icmp uge i64 %i.next, %inner\n"
           "  br i1 %done, label %end, label %loop\nend:\n  ret void\n}\n")


def silu_mul() -> int:
    """The address of @silu_mul(gate, inner): gate[i] = silu(gate[i]) * gate[inner + i] for i < inner (a multiple
    of 16), 16 at a time: the MLP's gate times up, in place over one row of the fused gate/up projection."""
    global _SILU
    if _SILU is None:
        _SILU = int(compile_ir(SILU_IR, ["silu_mul"], "silu")[0])
    return _SILU


_SILU = None


def exact(weight: torch.Tensor) -> bool:
    """True when `weight` (2-D float32 on the CPU, an even number of columns) holds only bfloat16 values, so 16
    bits of each keep all of it."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and not bool((weight.contiguous().view(torch.int32) & 0xFFFF).any()))


def high_halves(weight: torch.Tensor) -> np.ndarray:
    """The 16 high bits of each float32 weight (its bfloat16 value), two to a uint32: [N, K/2]."""
    halves = (weight.contiguous().view(torch.int32) >> 16).to(torch.int16)
    return halves.numpy().view(np.uint32)


class Weights:
    """A Llama-family model's weights as the kernels take them: per layer two norms, the q/k/v bias (or none) and
    the q/k/v, o, gate/up and down projections; then the final norm and the output layer. Each projection is a
    float32 tensor of bfloat16 values (kept as 16 bits) or a GGUF's blocks (block_tiles.Blocks). `projections` is
    consumed: each entry is let go once its kernels' copy is made (with q8, a repacked copy: the blocks can go)."""

    def __init__(self, norms: list[torch.Tensor], biases: list, projections: list,
                 final_norm: torch.Tensor, head, q8: bool = False, qk_norms: Optional[list] = None):
        # typed lists: the layer loop (_layers) takes them whole
        self.norms = typed_list([n.detach().float().contiguous().numpy() for n in norms])
        self.biases = typed_list([EMPTY if b is None else b.detach().float().contiguous().numpy() for b in biases])
        self.qk_norms = typed_list([NO_QK_NORM if n is None else n.detach().float().contiguous().numpy()
                                    for n in (qk_norms or [None] * len(biases))])
        kernel, self.nbytes = [], 0  # nbytes: what a forward reads
        for i, weight in enumerate(projections):
            kernel.append(_kernel_weight(weight, q8))
            self.nbytes += _reads(weight, kernel[-1], q8)
            projections[i] = None
        self.projections = typed_list(kernel)
        self.final_norm = final_norm.detach().float().contiguous().numpy()
        self.head = _kernel_weight(head, q8)
        self.nbytes += _reads(head, self.head, q8)


def typed_list(items: list) -> numba.typed.List:
    """A numba typed list of `items` (all of one type), built in compiled code that numba caches: numba.typed.List
    compiles its constructor and append for the items' type in every process (1.3 s of a second load of the
    default model)."""
    return _typed_list(tuple(items))


@numba.njit(cache=True)
def _typed_list(items):
    listed = numba.typed.List()
    for item in items:
        listed.append(item)
    return listed


def _reads(weight, kernel_weight, q8: bool) -> int:
    """The bytes a forward reads of one projection: 16 bits a weight, the float tiles' blocks and float32 scales, or
    q8_tiles' repacked blocks and scales."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * 2
    return kernel_weight[0].nbytes + kernel_weight[1].nbytes if q8 else weight.nbytes()


def _kernel_weight(weight, q8: bool):
    """A projection as its kernels take it: a tensor's 16 high bits, a GGUF's blocks (repacked for the q8 tiles with
    q8), or the q8 tiles' repacked copy as it is (q8_tiles.packed's tuple, from the disk: forward/repacked.py)."""
    if isinstance(weight, tuple):
        return q8_tiles.compiled(weight)
    return weight.weight(q8) if isinstance(weight, block_tiles.Blocks) else high_halves(weight)


@dataclass
class Apart:
    """A sequence whose attention runs in PyTorch's scaled_dot_product_attention (more rows than
    attention.FEW_ROWS: a GEMM beats the streaming kernel there): rows first.. of the batch, its cache, its mask."""

    first: int
    count: int
    cache: object
    mask: Optional[torch.Tensor]
    wide: Optional[torch.Tensor] = None  # a float16 cache's keys and values widen into this (attend_in_place)
    bfloat16: bool = False  # attend in prompt_attention's bfloat16 tiles (q8 activations, CPUs with AVX512-BF16)


def _attend_apart(apart: Apart, layer: int, qkv: np.ndarray, attended: np.ndarray, heads: int, kv_heads: int,
                  dim: int) -> None:
    """The sequence's attention in PyTorch or prompt_attention's tiles (either also writes its new keys and values)
    into `attended`."""
    rows = torch.from_numpy(qkv[apart.first : apart.first + apart.count]).view(apart.count, -1, dim)
    q, k, v = rows[:, :heads], rows[:, heads : heads + kv_heads], rows[:, heads + kv_heads :]
    keys, values, start, wide = apart.cache.keys[layer], apart.cache.values[layer], apart.cache.length, apart.wide
    written = keys.dtype == torch.int8
    if written:  # q8: written rounded, then the cache so far read as floats, as the kernel reads it
        end = start + apart.count
        attention.write_q8(keys.numpy(), values.numpy(), k.numpy(), v.numpy(), start)
        size = kv_heads * end * dim
        keys = attention.dequantized(keys[:, :end], True, wide[:size].view(kv_heads, end, dim))
        values = attention.dequantized(values[:, :end], False, wide[size : 2 * size].view(kv_heads, end, dim))
        k, v, wide = keys[:, start:].transpose(0, 1), values[:, start:].transpose(0, 1), None
    if apart.bfloat16:  # straight into `attended`
        prompt_attention.attend(q, k, v, keys, values, start, prompt_attention.kept(apart.cache, dim), layer,
                                attended[apart.first : apart.first + apart.count], write=not written)
        return
    out = attention.attend_in_place(q, k, v, keys, values, start, apart.mask, wide)
    attended[apart.first : apart.first + apart.count] = out.view(apart.count, heads, dim).numpy()


@numba.njit(fastmath=False, cache=True, boundscheck=False)
def _attend_kernels(qkv, table, layer, heads, kv_heads, scores, probabilities, attended, kernels, threads):
    """The attention of the sequences in `table` (attention.py's kernels) at `layer`, from the rotated q/k/v
    projection [rows, (heads + 2 kv_heads) dim], into attended [rows, heads, dim]. q and k go to the kernels as a
    contiguous copy: as a strided view they compile unvectorised (see the module's doc)."""
    rows, dim = qkv.shape[0], attended.shape[2]
    qk_size = (heads + kv_heads) * dim
    qk = np.ascontiguousarray(qkv[:, :qk_size]).reshape(rows, heads + kv_heads, dim)
    v = np.ascontiguousarray(qkv[:, qk_size:]).reshape(rows, kv_heads, dim)
    attention._attend(qk, v, table, layer, heads, kv_heads, scores, probabilities, attended, kernels, threads)


@numba.njit(fastmath=False, cache=True, boundscheck=False)
def _layers(x, norms, biases, qk_norms, projections, eps, turn, table, scores, probabilities, attended, heads,
            kv_heads, kernels, silu, threads):
    """Every layer over x [rows, hidden] in place, when every sequence attends in attention.py's kernels (on
    `threads` threads): the Python loop in `forward`, without its calls and array views (see the module's doc)."""
    rows, dim = x.shape[0], attended.shape[2]
    for layer in range(len(projections) // 4):
        qkv = _attention_in(x, norms[2 * layer], eps, projections[4 * layer], biases[layer], qk_norms[layer], turn,
                            (heads + kv_heads) * dim)
        _attend_kernels(qkv, table, layer, heads, kv_heads, scores, probabilities, attended, kernels, threads)
        _attention_out_and_mlp(x, attended.reshape(rows, heads * dim), projections[4 * layer + 1],
                               norms[2 * layer + 1], eps, projections[4 * layer + 2], projections[4 * layer + 3],
                               silu)


@numba.njit(fastmath=False, cache=True, boundscheck=False)
def _prompt_layers(x, norms, biases, qk_norms, projections, eps, turn, keys, values, start, laid_k, laid_v, laid_from,
                   attended, heads, kv_heads, silu, tiles, threads):
    """Every layer over a prompt chunk x [rows, hidden] in place, its attention in prompt_attention's tiles against
    its cache (keys, values [layers, kv_heads, capacity, dim]; laid_k, laid_v and laid_from: its kept layouts, see
    prompt_attention.attend): the Python loop in `forward`, without its calls (~0.1 ms a layer)."""
    rows, dim = x.shape[0], attended.shape[2]
    for layer in range(len(projections) // 4):
        qkv = _attention_in(x, norms[2 * layer], eps, projections[4 * layer], biases[layer], qk_norms[layer], turn,
                            (heads + kv_heads) * dim).reshape(rows, heads + 2 * kv_heads, dim)
        prompt_attention._chunk(qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :],
                                keys[layer], values[layer], start, True, laid_k[layer], laid_v[layer],
                                laid_from[layer], attended, tiles, threads)
        _attention_out_and_mlp(x, attended.reshape(rows, heads * dim), projections[4 * layer + 1],
                               norms[2 * layer + 1], eps, projections[4 * layer + 2], projections[4 * layer + 3],
                               silu)


def _prompt_chunk(weights: Weights, x: np.ndarray, turn: np.ndarray, cache, attended: np.ndarray, eps: float,
                  heads: int, kv_heads: int, silu: int) -> None:
    """A forward of one prompt chunk alone, attending in the tiles (a float16 or float32 cache): _prompt_layers."""
    dim, start = attended.shape[2], cache.length
    laid = prompt_attention.kept(cache, dim)
    laid_from = np.array([min(done, start) for done in laid.laid], dtype=np.int64)
    _prompt_layers(x, weights.norms, weights.biases, weights.qk_norms, weights.projections, eps, turn,
                   prompt_attention._elements(cache.keys), prompt_attention._elements(cache.values), start, laid.k,
                   laid.v, laid_from, attended, heads, kv_heads, silu, prompt_attention.kernels(dim),
                   numba.get_num_threads())
    laid.laid = [start + x.shape[0]] * len(laid.laid)


def forward(weights: Weights, x: torch.Tensor, rotary: torch.Tensor, table: Optional[torch.Tensor], score_rows: int,
            width: int, apart: list[Apart], keep: list[int], eps: float, heads: int, kv_heads: int,
            dim: int) -> torch.Tensor:
    """Every layer over x [rows, hidden] (float32) with rotary [rows, 1, dim/2] (complex), then the final norm and
    the output layer for the rows in `keep`: logits [len(keep), vocab]. The sequences in `table`
    (attention.make_table, with `score_rows` query heads against up to `width` keys) attend in attention.py's
    kernels, the ones `apart` in PyTorch; either way their new keys and values go into their caches."""
    attention.match_threads()
    rows = x.shape[0]
    x = x.contiguous().numpy().copy()
    turn = torch.view_as_real(rotary.reshape(rows, -1)).contiguous().numpy()  # [rows, dim/2, (cos, sin)]
    attended = np.empty((rows, heads, dim), dtype=np.float32)
    kernels, silu = attention_tiles.kernels(dim), silu_mul()
    if table is not None:
        table = table.numpy()
        scores, probabilities = attention._scratch(score_rows * width)
        scores = scores[: score_rows * width].view(score_rows, width).numpy()
        probabilities = probabilities[: score_rows * width].view(score_rows, width).numpy()
        if not apart:  # the whole layer loop in numba
            _layers(x, weights.norms, weights.biases, weights.qk_norms, weights.projections, eps, turn, table, scores,
                    probabilities, attended, heads, kv_heads, kernels, silu, numba.get_num_threads())
            return torch.from_numpy(_output(x[keep], weights.final_norm, eps, weights.head))
    if table is None and len(apart) == 1 and apart[0].bfloat16 and apart[0].cache.keys.dtype != torch.int8:
        _prompt_chunk(weights, x, turn, apart[0].cache, attended, eps, heads, kv_heads, silu)
        return torch.from_numpy(_output(x[keep], weights.final_norm, eps, weights.head))
    for layer in range(len(weights.projections) // 4):
        qkv_w, o_w, gate_up_w, down_w = weights.projections[4 * layer : 4 * layer + 4]
        qkv = _attention_in(x, weights.norms[2 * layer], eps, qkv_w, weights.biases[layer], weights.qk_norms[layer],
                            turn, (heads + kv_heads) * dim)
        if table is not None:
            _attend_kernels(qkv, table, layer, heads, kv_heads, scores, probabilities, attended, kernels,
                            numba.get_num_threads())
        for sequence in apart:
            _attend_apart(sequence, layer, qkv, attended, heads, kv_heads, dim)
        _attention_out_and_mlp(x, attended.reshape(rows, heads * dim), o_w, weights.norms[2 * layer + 1], eps,
                               gate_up_w, down_w, silu)
    return torch.from_numpy(_output(x[keep], weights.final_norm, eps, weights.head))


@functools.cache
def ready() -> bool:
    """True where the capability table lets the kernels run (numba's OpenMP pool), attention's loaded. The layers'
    own kernels load (or compile) in the forward's warm-up (lean.LeanLlama._warm), for the weights it holds: a
    warm-up here, on a tiny model of float weights, loaded signatures (`_layers`, `_output`, typed lists) that a
    model of q8 blocks never calls, ~0.1 s of every second load (and compiled them on a first). A machine's first
    run is told it compiles by attention.ready(), whose kernels compile first."""
    return capabilities.available("layers") and attention.ready()
