"""A GGUF's own 4-bit and 8-bit weights in the few-row forward (`--weights gguf`, and `auto`, the default, on
CPUs in float32): a quarter of the bytes.

The default model ships as a Q4_1 GGUF (every layer's projections; the tied embedding and output layer in Q8_0),
which is what llama-server runs. `codespec pull` stores it as bfloat16, which rounds those values; with
`--weights gguf` codespec runs the file's own numbers instead:

- **The blocks as they are.** Q4_1 keeps 32 weights as 4-bit q with a float16 scale d and minimum m
  (w = q * d + m), Q8_0 as signed 8-bit q with a scale (w = q * d). The projections keep q as the file has it
  (66 MB for the default model's layers, against 212 MB as 16 bits); d and m are widened to float32.
- **Every type people download** (FORMATS): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K (what
  Q4_K_M, Q5_K_M and Q6_K files hold) are read into five tile layouts (KINDS), each weight exactly the value
  llama.cpp's dequantisation gives: 4-bit nibbles with a minimum (Q4_0 with m = -8 d; Q4_K with each 32-weight
  sub-block's scale d * sc and minimum -dmin * m, exact float32 products), or bytes (Q5_* and Q5_K's five bits,
  Q6_K's six less 32 with a scale per 16 weights, Q8_0). A fused q/k/v or gate/up whose parts differ (Q4_K_M
  keeps some v and down projections in Q6_K) takes the one layout that holds them all. The 5- and 6-bit types
  read a byte a weight: more than the file's 5.5-6.6 bits, fewer than 16.
- **Or activations rounded to 8 bits** (--activations q8, the default on x86 CPUs with AVX2): q8_tiles.py
  repacks the blocks for its integer kernels (every layout, on AVX2 and on AVX512-VNNI); the float tiles below are
  then not built.
- **The float32 weights are the same numbers.** The model's float32 parameters are overwritten with the
  dequantised blocks (each q * d + m rounded once, as the kernel's fused multiply-add rounds it), so forwards over
  more rows (prompts, long verifies in PyTorch) and the kernel multiply by the same weights. A q/k scale that is
  not a power of two (head_dim not a power of 4) rounds the kernel's q weights once more than PyTorch's.
- **Kernels in LLVM IR.** numba leaves the nibble unpacking scalar, so the kernel is written as LLVM IR with
  explicit 16-wide vectors and compiled by llvmlite (numba's own LLVM, a wheel: no compiler) for this CPU when
  the model loads (0.1 s). A tile computes one output column for up to four rows; each (row, column) is the same
  sequence of operations in every tile: per block, w = fma(q, d, m) and two 16-lane sums a += w * x, then
  the two sums added and halved down to one number in a fixed order. So a row's projections do not depend on
  which rows share its forward (`tests/unit/test_block_tiles.py`), and neither does attention over the cache
  (attention.py): a verify forward of up to 16 rows gives each row the logits of one-token forwards, bit for bit.

The numba driver (`linear`) runs chunks of 16 output columns per thread, as many rows at a time as a tile takes (four,
three, two or one with AVX-512's 32 vector registers; two or one with AVX2's 16), so that each unpacked block serves
several rows.
"""

from __future__ import annotations

import concurrent.futures
import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import torch
from numba import prange

from . import capabilities
from .ir import FMA, FMA_DECLARATION, VECTOR
from .native import call, compile_ir
from ...errors import CodespecError


@dataclass(frozen=True)
class Layout:
    """How the tiles read a block of 32 weights: q as 16 bytes of 4-bit nibbles (bits 4: byte i holds weight i low
    and weight 16 + i high, llama.cpp's order) or 32 signed bytes (bits 8); w = q * d + m with a stored m (minimum),
    or w = (q - offset) * d, computed as fma(q, d, -offset * d) (one rounding, as llama.cpp's); one d (and m) per
    block, or two (per 16 weights). (5- and 6-bit types run as bytes: nibbles plus a plane of the higher bits,
    unpacked in the tile, read 40% fewer bytes but took 41 ms a forward at k = 1 against 33 ms as bytes for the
    Qwen2.5-Coder-0.5B shape in Q4_K_M, 2-core AVX2, alternating runs: the unpacking, not the bytes, bounds it.)"""
    bits: int
    minimum: bool
    scales: int = 1
    offset: int = 0

    @property
    def q_bytes(self) -> int:
        return {4: 16, 8: 32}[self.bits]

    @property
    def name(self) -> str:
        named = {layout: name for name, layout in KINDS.items()}
        return named.get(self) or f"L{self.bits}{'m' if self.minimum else ''}x{self.scales}o{self.offset}"


# The tiles' layouts, named after the llama.cpp block each holds (or extends); the GGUF types each reads: FORMATS.
KINDS = {
    "Q4_1": Layout(4, True),  # Q4_1; Q4_K (d and m its sub-block's scale and minimum)
    "Q4_0": Layout(4, False, offset=8),
    "Q8_0": Layout(8, False),  # Q8_0; Q5_0 (its five bits less 16)
    "Q8_M": Layout(8, True),  # Q5_1 and Q5_K: five bits as bytes, with a minimum
    "Q8_16": Layout(8, False, 2),  # Q6_K: six bits less 32 as bytes, a scale per 16 weights
}


def kind_of(layout: Layout) -> str:
    """The name of `layout`, registered in KINDS (the layouts _common makes for mixed fused projections)."""
    name = layout.name
    KINDS.setdefault(name, layout)
    return name


def tile_rows(wide_registers: bool) -> np.ndarray:
    """The rows of each tile, one output column each, most first. A row's two 16-lane sums take two of AVX-512's 32
    registers, but four of AVX2's 16: there the 3- and 4-row tiles spill sums to the stack in the loop (the 4-row
    Q4_1 tile: 23 stack accesses against the 2-row's 3, its arguments), and a forward over 16 rows took 64-88 ms
    with 2-row tiles against 79-102 ms with 4-row ones (the default model, 4 alternating runs each). On AVX-512,
    measured: 8 rows were no faster; a forward over 3 rows took two passes (2 + 1 rows), 13.8 ms at 300 cached
    tokens, and 9.8 ms with the 3-row tile; two or four columns no faster, and four columns of the Q8_0 output
    layer 2.2x slower."""
    return np.array([4, 3, 2, 1] if wide_registers else [2, 1])


ROWS = tile_rows(capabilities.available("four-row block tiles"))  # (numba's cache keeps a compiled driver per CPU: it reads ROWS)
CHUNK = 16  # output columns a thread takes at a time



def _splat(name: str, value: str) -> str:
    return (f"  %{name}.1 = insertelement {VECTOR} poison, float {value}, i64 0\n"
            f"  %{name} = shufflevector {VECTOR} %{name}.1, {VECTOR} poison, <16 x i32> zeroinitializer\n")


def _lanes(first: int, last: int) -> str:
    return ", ".join(f"i32 {i}" for i in range(first, last))


def _sum(name: str, a: str, b: str) -> str:
    """%name = the 32 lanes of a and b added: a + b, then halves added down to one, in a fixed order."""
    text, width, source = f"  %{name}.16 = fadd {VECTOR} {a}, {b}\n", 16, f"%{name}.16"
    while width > 1:
        half = width // 2
        for side, lanes in (("a", _lanes(0, half)), ("b", _lanes(half, width))):
            text += (f"  %{name}.{half}{side} = shufflevector <{width} x float> {source}, <{width} x float> poison, "
                     f"<{half} x i32> <{lanes}>\n")
        text += f"  %{name}.{half} = fadd <{half} x float> %{name}.{half}a, %{name}.{half}b\n"
        source, width = f"%{name}.{half}", half
    return text + f"  %{name} = extractelement <1 x float> %{name}.1, i64 0\n"


def _block(kind: str, rows: int) -> str:
    """One block of 32 weights (block %b) into the sums %a{j}_s{h}: w = q * d + m (or (q - offset) * d) as two
    halves of 16 lanes, then for each row j: a += w * x (one fused multiply-add per half)."""
    layout = KINDS[kind]
    text = f"  %qbb = mul i64 %b, {layout.q_bytes}\n  %qpb = getelementptr i8, ptr %q0, i64 %qbb\n"
    if layout.bits == 4:  # nibbles: byte i holds weight i (low) and weight 16 + i (high)
        text += ("  %qvb = load <16 x i8>, ptr %qpb, align 1\n  %qwb = zext <16 x i8> %qvb to <16 x i32>\n"
                 "  %lob = and <16 x i32> %qwb, splat (i32 15)\n  %hib = lshr <16 x i32> %qwb, splat (i32 4)\n")
        text += f"  %qb0 = uitofp <16 x i32> %lob to {VECTOR}\n  %qb1 = uitofp <16 x i32> %hib to {VECTOR}\n"
    else:  # 32 signed bytes
        text += (f"  %qvb = load <32 x i8>, ptr %qpb, align 1\n  %qwb = sext <32 x i8> %qvb to <32 x i32>\n"
                 f"  %qfb = sitofp <32 x i32> %qwb to <32 x float>\n"
                 f"  %qb0 = shufflevector <32 x float> %qfb, <32 x float> poison, <16 x i32> <{_lanes(0, 16)}>\n"
                 f"  %qb1 = shufflevector <32 x float> %qfb, <32 x float> poison, <16 x i32> <{_lanes(16, 32)}>\n")
    for h in range(layout.scales):  # scale (and minimum) s of the block: index b * scales + s
        text += f"  %sib{h} = mul i64 %b, {layout.scales}\n  %si{h}b = add i64 %sib{h}, {h}\n"
        text += f"  %dp{h}b = getelementptr float, ptr %d0, i64 %si{h}b\n  %db{h}b = load float, ptr %dp{h}b, align 4\n"
        text += _splat(f"dv{h}b", f"%db{h}b")
        if layout.minimum:
            text += (f"  %mp{h}b = getelementptr float, ptr %m0, i64 %si{h}b\n"
                     f"  %mb{h}b = load float, ptr %mp{h}b, align 4\n")
            text += _splat(f"mv{h}b", f"%mb{h}b")
        elif layout.offset:  # m = -offset * d: exact (a power of two times d)
            text += f"  %mv{h}b = fmul {VECTOR} %dv{h}b, splat (float {-float(layout.offset)})\n"
    for h in (0, 1):
        s = h if layout.scales == 2 else 0
        text += (f"  %wb{h} = call {VECTOR} {FMA}({VECTOR} %qb{h}, {VECTOR} %dv{s}b, {VECTOR} %mv{s}b)\n"
                 if layout.minimum or layout.offset else f"  %wb{h} = fmul {VECTOR} %qb{h}, %dv{s}b\n")
    text += "  %xbb = mul i64 %b, 32\n"
    for j in range(rows):
        for h in (0, 1):
            text += (f"  %xp{j}b{h} = getelementptr float, ptr %x{j}, i64 %xbb\n" if h == 0 else
                     f"  %xp{j}b{h} = getelementptr float, ptr %xp{j}b0, i64 16\n")
            text += (f"  %x{j}b{h} = load {VECTOR}, ptr %xp{j}b{h}, align 4\n"
                     f"  %a{j}_s{h}.next = call {VECTOR} {FMA}({VECTOR} %wb{h}, {VECTOR} %x{j}b{h}, "
                     f"{VECTOR} %a{j}_s{h})\n")
    return text


def tile_ir(name: str, kind: str, rows: int) -> str:
    """LLVM IR of @name(x, K, q, d, m, n, N, out, r): out[r + j, n] = x[r + j] . w[n] for `rows` rows j, where
    w's rows are blocks of `kind` (q: [N, K / 32 * bytes], d and m: [N, K / 32 * scales] float32). Each row sums into
    two 16-lane sums, added and halved down to one at the end in a fixed order. (Measured: two columns a tile,
    or four sums a row for blocks in pairs, were no faster.)"""
    layout = KINDS[kind]
    text = (f"define void @{name}(ptr noalias %x, i64 %K, ptr noalias %q, ptr noalias %d, ptr noalias %m, i64 %n, "
            f"i64 %N, ptr noalias %out, i64 %r) {{\nentry:\n  %blocks = udiv i64 %K, 32\n"
            f"  %row_bytes = mul i64 %blocks, {layout.q_bytes}\n  %qo = mul i64 %n, %row_bytes\n"
            f"  %q0 = getelementptr i8, ptr %q, i64 %qo\n  %sn = mul i64 %n, %blocks\n"
            f"  %so = mul i64 %sn, {layout.scales}\n"
            f"  %d0 = getelementptr float, ptr %d, i64 %so\n  %m0 = getelementptr float, ptr %m, i64 %so\n")
    for j in range(rows):
        text += (f"  %r{j} = add i64 %r, {j}\n  %xo{j} = mul i64 %r{j}, %K\n"
                 f"  %x{j} = getelementptr float, ptr %x, i64 %xo{j}\n")
    text += "  br label %loop\nloop:\n  %b = phi i64 [ 0, %entry ], [ %b.next, %loop ]\n"
    for j in range(rows):
        for h in (0, 1):
            text += f"  %a{j}_s{h} = phi {VECTOR} [ zeroinitializer, %entry ], [ %a{j}_s{h}.next, %loop ]\n"
    text += _block(kind, rows)
    text += ("  %b.next = add i64 %b, 1\n  %done = icmp eq i64 %b.next, %blocks\n"
             "  br i1 %done, label %end, label %loop\nend:\n")
    for j in range(rows):
        text += _sum(f"s{j}", f"%a{j}_s0.next", f"%a{j}_s1.next")
        text += (f"  %oo{j} = mul i64 %r{j}, %N\n  %oi{j} = add i64 %oo{j}, %n\n"
                 f"  %op{j} = getelementptr float, ptr %out, i64 %oi{j}\n  store float %s{j}, ptr %op{j}, align 4\n")
    return text + "  ret void\n}\n"


def source(kind: str, rows_each=None) -> tuple[str, list[str]]:
    """The IR module of `kind`'s tiles (one per entry of rows_each, by default this CPU's ROWS) and their names."""
    rows_each = ROWS if rows_each is None else rows_each
    names = [f"{kind.lower()}_{rows}" for rows in rows_each]
    return FMA_DECLARATION + "".join(
        tile_ir(name, kind, rows) for name, rows in zip(names, rows_each)), names


@functools.cache
def tiles(kind: str) -> np.ndarray:
    """The addresses of `kind`'s tiles (one per entry of ROWS), compiled for this CPU."""
    return compile_ir(*source(kind), "float block tiles")


@numba.njit(fastmath=False, cache=True, boundscheck=False)
def sum_of_squares(x):
    """x . x (float32 [n]) in one order whatever calls it: eight running sums over x[i::8] (the tail's into the
    first), added pairwise. Without fast-math, so no caller's flags and no inlining can reorder it: the order of a
    fast-math loop's sum is LLVM's pick, and the pick followed what the loop was compiled into (a process that
    compiled the kernels could then differ from one that loaded them from numba's cache)."""
    n = x.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    for i in range(0, n - n % 8, 8):
        s0 += x[i] * x[i]
        s1 += x[i + 1] * x[i + 1]
        s2 += x[i + 2] * x[i + 2]
        s3 += x[i + 3] * x[i + 3]
        s4 += x[i + 4] * x[i + 4]
        s5 += x[i + 5] * x[i + 5]
        s6 += x[i + 6] * x[i + 6]
        s7 += x[i + 7] * x[i + 7]
    for i in range(n - n % 8, n):
        s0 += x[i] * x[i]
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@numba.njit(fastmath=True, cache=True, boundscheck=False)
def normed(x, norm, eps):
    """x's rows RMS-normalised and times `norm` (when norm has entries; else a contiguous copy of x)."""
    rows, size = x.shape
    out = np.empty((rows, size), dtype=np.float32)
    for r in range(rows):
        scale = np.float32(1.0)
        if norm.shape[0]:
            scale = np.float32(1.0) / np.sqrt(sum_of_squares(x[r]) / np.float32(size) + eps)
        for i in range(size):
            out[r, i] = x[r, i] * scale * (norm[i] if norm.shape[0] else np.float32(1.0))
    return out


@numba.njit(fastmath=False, parallel=True, cache=True, boundscheck=False)
def linear(x, norm, eps, weight):
    """rms_norm(x) (when norm has entries, else x) times the transposed block weight (q, d, m, tiles): [rows, N]."""
    q, d, m, tile = weight
    xn = normed(x, norm, eps)
    rows, size = xn.shape
    outputs = q.shape[0]
    out = np.empty((rows, outputs), dtype=np.float32)
    for chunk in prange((outputs + CHUNK - 1) // CHUNK):
        # the addresses are taken here, in the loop: taken before it, numba may free xn once they are read
        X, Q, D, M, O = xn.ctypes.data, q.ctypes.data, d.ctypes.data, m.ctypes.data, out.ctypes.data
        r = 0
        while r < rows:
            t = 0
            while ROWS[t] > rows - r:  # the most rows that fit: they share each unpacked block
                t += 1
            for n in range(chunk * CHUNK, min(outputs, chunk * CHUNK + CHUNK)):
                call(tile[t], X, size, Q, D, M, n, outputs, O, r)
            r += ROWS[t]
    return out


QK_K = 256  # weights in a K-quant super-block


def _halves(raw: np.ndarray, offset: int) -> np.ndarray:
    """float16 values stored at byte `offset` of each block, widened to float32: [N, blocks]."""
    return raw[:, :, offset : offset + 2].copy().view(np.float16)[:, :, 0].astype(np.float32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's eight 6-bit sub-block scales and minimums, packed in 12 bytes: [N, S, 12] -> 2 x [N, S, 8]."""
    d, m, both = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 63, (both & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (both >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def _k_quant(raw: np.ndarray, q: np.ndarray, scale: int = 4) -> tuple:
    """Q4_K / Q5_K: q [N, S, 8, 32] (the super-block's eight sub-blocks of 32) and the super-block's float16 d and
    dmin at bytes 0 and 2, the sub-block scales and minimums at byte 4: w = (d sc) q - dmin mn, both products
    exact in float32 (11 bits times 6), so one rounding as llama.cpp's; and the super-blocks' d and -dmin
    [N, S, 2] (`Blocks.base`)."""
    sc, mn = _k_scales(raw[:, :, scale : scale + 12])
    d, dmin = _halves(raw, 0), _halves(raw, 2)
    n = raw.shape[0]
    return (q.reshape(n, -1, 32), (d[..., None] * sc).reshape(n, -1, 1), -(dmin[..., None] * mn).reshape(n, -1, 1),
            np.stack([d, -dmin], axis=-1))


def _q4_k(raw):
    """Q4_K, 144 bytes per 256 weights: d, dmin, 12 bytes of scales, then 128 bytes where each 32 bytes hold two
    sub-blocks (the low nibbles one, the high nibbles the next)."""
    qs = raw[:, :, 16:].reshape(raw.shape[0], raw.shape[1], 4, 1, 32)
    return _k_quant(raw, np.concatenate([qs & 15, qs >> 4], axis=3))


def _q5_k(raw):
    """Q5_K, 176 bytes per 256 weights: as Q4_K, with 32 bytes of fifth bits (bit s of byte i: sub-block s's
    weight i) before the nibbles."""
    n, s = raw.shape[:2]
    qs = raw[:, :, 48:].reshape(n, s, 4, 1, 32)
    low = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, s, 8, 32)
    high = (raw[:, :, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
    return _k_quant(raw, low | (high << 4))


def _q6_k(raw):
    """Q6_K, 210 bytes per 256 weights: 128 bytes of low nibbles, 64 of two high bits each, 16 signed 8-bit
    scales (one per 16 weights), d: w = (d sc) (q - 32), one rounding as llama.cpp's."""
    n, s = raw.shape[:2]
    ql = raw[:, :, :128].reshape(n, s, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = raw[:, :, 128:192].reshape(n, s, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = ((ql & 15).reshape(n, s, 8, 32) | ((qh & 3).reshape(n, s, 8, 32) << 4)).view(np.int8) - np.int8(32)
    scales = raw[:, :, 192:208].view(np.int8).astype(np.float32)
    d = _halves(raw, 208)  # (the minimums' base: -32 d, the minimum of a block held plus 32, q8_tiles.packed)
    return (q.reshape(n, -1, 32), (d[..., None] * scales).reshape(n, -1, 2), None, np.stack([d, -32 * d], axis=-1))


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """llama.cpp's 4-bit order (byte i: weight i in the low nibble, weight 16 + i in the high), [..., 16] -> [..., 32]."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def _five_bits(raw, q_at: int, qh_at: int) -> np.ndarray:
    """Q5_0 / Q5_1's values: nibbles at q_at, fifth bits at qh_at (a little-endian uint32, bit i for weight i)."""
    high = np.unpackbits(raw[:, :, qh_at : qh_at + 4], axis=-1, bitorder="little")
    return (_nibbles(raw[:, :, q_at : q_at + 16]) | (high << 4)).astype(np.int16)


# Each GGUF type the tiles read: its block (weights, bytes), the layout it runs in, and how a tensor's raw blocks
# [N, blocks, bytes] become q, d and m [N, blocks of 32, scales] (float32; m None where there is none) with
# w = q * d + m: q integers [N, blocks of 32, 32], or (uint8, the layout's q_bytes wide) the layout's own bytes;
# and for K-quants the super-blocks' float16 scales (Blocks.base; None for the others).
FORMATS = {
    "Q4_0": (32, 18, "Q4_0", lambda r: (r[:, :, 2:], _halves(r, 0)[..., None], None, None)),
    "Q4_1": (32, 20, "Q4_1", lambda r: (r[:, :, 4:], _halves(r, 0)[..., None], _halves(r, 2)[..., None], None)),
    "Q5_0": (32, 22, "Q8_0", lambda r: (_five_bits(r, 6, 2) - 16, _halves(r, 0)[..., None], None, None)),
    "Q5_1": (32, 24, "Q8_M", lambda r: (_five_bits(r, 8, 4), _halves(r, 0)[..., None], _halves(r, 2)[..., None],
                                        None)),
    "Q8_0": (32, 34, "Q8_0", lambda r: (r[:, :, 2:].view(np.int8), _halves(r, 0)[..., None], None, None)),
    "Q4_K": (QK_K, 144, "Q4_1", _q4_k),
    "Q5_K": (QK_K, 176, "Q8_M", _q5_k),
    "Q6_K": (QK_K, 210, "Q8_16", _q6_k),
}


def _common(kinds: set) -> str:
    """The one layout that holds blocks of all `kinds` exactly (the fused q/k/v and gate/up of a file whose
    projections mix types, as Q4_K_M files do): the most bits and scales of any, with a minimum where one has one
    (a signed part's offset then becomes its minimum), else nibbles' offset of 8."""
    if len(kinds) == 1:
        return next(iter(kinds))
    layouts = [KINDS[kind] for kind in kinds]
    bits, scales = max(layout.bits for layout in layouts), max(layout.scales for layout in layouts)
    minimum = any(layout.minimum for layout in layouts)
    offset = 0 if minimum or bits == 8 else 8
    return kind_of(Layout(bits, minimum, scales, offset))


READ_ROWS = 8192  # rows of a tensor decoded at a time (Blocks.read)


class Blocks:
    """One GGUF tensor's blocks in a tile layout (KINDS), row by row: q [N, K / 32 * q_bytes] (uint8), d and m
    [N, K / 32 * scales] (float32; m [N, 0] where the layout has no minimum). `source`: the GGUF type(s). `base`:
    for K-quants, each super-block's float16 d and -dmin [N, K / 256, 2] (float32), of which its d's and m's are
    small integer multiples (the q8 tiles then hold those integers, as the file does: q8_tiles.packed checks
    that they are); else None."""

    def __init__(self, kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray, source: str = "", base=None):
        self.kind, self.q, self.d, self.m, self.source, self.base = kind, q, d, m, source or kind, base

    @classmethod
    def read(cls, tensor, rows=None) -> "Blocks":
        """The blocks of a GGUF tensor (gguf's ReaderTensor), or of its rows `rows` (indices)."""
        source = tensor.tensor_type.name
        if source not in FORMATS:
            raise CodespecError(f"--weights gguf reads {', '.join(FORMATS)} blocks; {tensor.name} is {source}")
        weights, size, kind, decode = FORMATS[source]
        raw = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1, size)
        if rows is not None:
            raw = raw[rows]
        if raw.shape[0] <= READ_ROWS:
            *qdm, base = decode(raw)
            return cls.of(kind, *qdm, source, base)
        # rows a chunk at a time: decoding a large tensor whole (a 152k-token output layer) took temporaries of
        # several times its size (peak RSS 3.5 GB for a 1 GB file)
        parts = []
        for start in range(0, raw.shape[0], READ_ROWS):
            *qdm, base = decode(raw[start : start + READ_ROWS])
            parts.append(cls.of(kind, *qdm, source, base))
        return cls.cat(parts)

    @classmethod
    def of(cls, kind: str, q: np.ndarray, d: np.ndarray, m, source: str = "", base=None) -> "Blocks":
        """Blocks of layout `kind` for w = q * d + m: q integers [N, B, 32] (or the layout's own bytes, uint8
        [N, B, q_bytes]), d and m [N, B, 1 or scales] (m None: none); `base` as the class says."""
        layout = KINDS[kind]
        n = q.shape[0]
        if d.shape[2] != layout.scales:  # one scale a block, repeated for both halves
            d = np.repeat(d, layout.scales, axis=2)
            m = None if m is None else np.repeat(m, layout.scales, axis=2)
        if q.dtype == np.uint8 and q.shape[-1] == layout.q_bytes:
            stored = q
        elif layout.bits == 8:
            if not layout.minimum and m is not None and np.any(m):
                raise ValueError(f"layout {kind} has no minimum to hold")
            stored = q.astype(np.int8, copy=False).view(np.uint8)
        else:
            unsigned = q.dtype == np.uint8 and layout.minimum  # (a K-quant's nibbles: no copy in 16 bits)
            values = q if unsigned else q.astype(np.int16)
            if not layout.minimum:  # (q - offset) * d
                if m is not None and np.any(m):
                    raise ValueError(f"layout {kind} has no minimum to hold")
                values = values + layout.offset
            elif not unsigned and values.min(initial=0) < 0:  # a signed part with a minimum: q + shift, m - shift d
                shift = 1 << (layout.bits - 1)
                values = values + shift
                m = (np.zeros_like(d) if m is None else m) - shift * d
            if (not unsigned and values.min(initial=0) < 0) or values.max(initial=0) >= 1 << layout.bits:
                raise ValueError(f"values out of {kind}'s {layout.bits} bits")
            stored = ((values[..., :16] & 15) | ((values[..., 16:] & 15) << 4)).astype(np.uint8, copy=False)
        if layout.minimum:
            m = np.zeros_like(d) if m is None else m
            minimums = np.ascontiguousarray(m.reshape(n, -1), np.float32)
        else:
            minimums = np.zeros((n, 0), np.float32)
        return cls(kind, np.ascontiguousarray(stored.reshape(n, -1)), np.ascontiguousarray(d.reshape(n, -1), np.float32),
                   minimums, source, base)

    def integers(self, narrow: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """q [N, B, 32] (int16; narrow: int8 or, for unsigned nibbles, uint8, which only q8_tiles.packed takes), d
        and m [N, B, scales] (m None where there is none) with w = q * d + m: what `of` takes."""
        layout = KINDS[self.kind]
        n = self.q.shape[0]
        stored = self.q.reshape(n, -1, layout.q_bytes)
        blocks = stored.shape[1]
        if layout.bits == 8:
            q = stored.view(np.int8) if narrow else stored.view(np.int8).astype(np.int16)
        else:
            q = _nibbles(stored)
            if layout.offset or not narrow:
                q = q.astype(np.int16) - layout.offset
        d = self.d.reshape(n, blocks, layout.scales)
        return q, d, self.m.reshape(n, blocks, layout.scales) if layout.minimum else None

    def nbytes(self) -> int:
        """What the float tiles read of these blocks: q and the float32 scales (and minimums)."""
        return self.q.nbytes + self.d.nbytes + self.m.nbytes

    def take(self, ids) -> torch.Tensor:
        """The float32 values of rows `ids` (an embedding lookup in the blocks)."""
        return self.rows(ids).values()

    def rows(self, index) -> "Blocks":
        return Blocks(self.kind, self.q[index], self.d[index], self.m[index], self.source,
                      None if self.base is None else self.base[index])

    def scaled(self, scale: float) -> "Blocks":
        """The same blocks times `scale` (a power of two keeps every weight exact)."""
        def times(values):
            return None if values is None else (values.astype(np.float64) * scale).astype(np.float32)
        return Blocks(self.kind, self.q, times(self.d), times(self.m), self.source, times(self.base))

    def as_kind(self, kind: str) -> "Blocks":
        """The same weights in layout `kind` (one that holds them: _common)."""
        return self if kind == self.kind else Blocks.of(kind, *self.integers(), self.source, self.base)

    @staticmethod
    def cat(parts: list["Blocks"]) -> "Blocks":
        """Blocks of the same inputs, their rows one after another, in the one layout that holds them all."""
        kind = _common({p.kind for p in parts})
        parts = [p.as_kind(kind) for p in parts]
        sources = "+".join(dict.fromkeys(p.source for p in parts))
        bases = [p.base for p in parts]
        base = None if any(b is None for b in bases) else np.concatenate(bases)
        return Blocks(kind, *(np.concatenate([getattr(p, a) for p in parts]) for a in "qdm"), sources, base)

    def values(self) -> torch.Tensor:
        """The weights [N, K] in float32, each q * d + m rounded once as the kernel's fused multiply-add rounds it
        (formed exactly in float64: q * d has at most 25 significant bits)."""
        q, d, m = self.integers()
        n, blocks, scales = d.shape
        w = q.reshape(n, blocks, scales, 32 // scales).astype(np.float64) * d[..., None]
        if m is not None:
            w += m[..., None]
        return torch.from_numpy(w.reshape(n, blocks * 32).astype(np.float32))

    def weight(self, q8: bool = False) -> tuple:
        """What `linear` takes, or with q8 what q8_tiles.linear takes (nibbles 0..15 with a minimum, or bytes)."""
        if q8:
            from . import q8_tiles

            return q8_tiles.repack(KINDS[self.kind].bits, self.q.shape[0], self._q8_integers, self.planes())
        return (self.q, self.d, self.m, tiles(self.kind))

    def q8_packed(self, isa: str) -> tuple:
        """The blocks as the q8 tiles of instruction set `isa` read them, not compiled (q8_tiles.packed: for a CPU
        this one is not, as tests/emulated/arm64.py prepares ARM64's)."""
        from . import q8_tiles

        return q8_tiles.packed(KINDS[self.kind].bits, self.q.shape[0], self._q8_integers, isa, self.planes())

    def planes(self) -> int:
        """1 where the widest weights are five bits (Q5_0, Q5_1 or Q5_K blocks, alone or fused with 4-bit ones), 2
        where six (Q6_K), else 0: q8_tiles holds those as nibbles and planes of the higher bits where it can."""
        return planes(set(self.source.split("+")))

    def _q8_integers(self, first: int, last: int) -> tuple:
        """(q, d, m, base) of rows first..last as q8_tiles takes them: nibbles with a minimum (Q4_0: m = -8 d), or
        bytes."""
        rows = self.rows(slice(first, last))
        return (*(rows.as_kind("Q4_1") if KINDS[self.kind].bits == 4 else rows).integers(narrow=True), rows.base)


def planes(types: set) -> int:
    """Blocks.planes of a tensor of these GGUF types."""
    from . import q8_tiles

    most = max(q8_tiles.BITS.get(t, 8) for t in types)
    return most - 4 if most in (5, 6) else 0


def _reader(path: Path):
    """gguf's GGUFReader, skipping over the contents of arrays (the tokenizer's vocabulary, merges, scores and token
    types, of no use here): reading them took 4 of the 5 seconds a load spent in this module, and the numeric ones
    another ~1 s. The last file read is kept,
    so that --weights auto's check and read_gguf parse it once (0.75 s)."""
    stat = Path(path).stat()
    return _read(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read(path: str, size: int, modified: int):
    return arrays_skipped()(path)


@functools.cache
def arrays_skipped():
    """gguf.GGUFReader less the contents of the metadata's arrays: each is stepped over (strings by their lengths,
    numbers whole), its field holding no values. gguf reads them an element at a time, 3-5 s for a 49-152k-token
    vocabulary."""
    import gguf

    class ArraysSkipped(gguf.GGUFReader):
        def _get_field_parts(self, offs, raw_type):
            if raw_type == gguf.GGUFValueType.ARRAY and self.byte_order != "S":
                item_type, count = int(self._get(offs, np.uint32)[0]), int(self._get(offs + 4, np.uint64)[0])
                if item_type == gguf.GGUFValueType.STRING:
                    raw, end, length = self.data, offs + 12, struct.Struct("<Q").unpack_from
                    for _ in range(count):  # each string: its length (uint64), then its bytes
                        end += 8 + length(raw, end)[0]  # (unpack_from: no slice made, 0.6x int.from_bytes' time)
                    return end - offs, [], [], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
                scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(item_type))
                if scalar is not None:  # numbers (the tokens' scores and types): skipped whole, not one by one
                    size = 12 + count * np.dtype(scalar).itemsize
                    return size, [], [], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(item_type)]
            return super()._get_field_parts(offs, raw_type)

        def _get(self, offset, dtype, count=1, override_order=None):
            """gguf's _get on a plain array over the mapped file: slicing the np.memmap itself made a memmap
            object per value read, ~45 us each, 0.25 of the 0.42 s a load of the default model spent reading its
            header (the tensors' arrays are views of the same mapping either way)."""
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            values = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return values.view(values.dtype.newbyteorder(order))

    return ArraysSkipped


def field(path: Path, name: str):
    """The value of the GGUF's metadata field `name` (a number or a string), or None where it has none."""
    found = _reader(path).fields.get(name)
    if found is None or not found.data:
        return None
    value = found.parts[found.data[0]]
    return bytes(value).decode() if found.types and found.types[0].name == "STRING" else value.tolist()[0]


def embedding_rows(path: Path) -> int | None:
    """The rows of the GGUF's token embedding (its vocabulary as the model sees it), or None without one."""
    found = next((t for t in _reader(path).tensors if t.name == "token_embd.weight"), None)
    return None if found is None else int(found.shape[-1])


def architecture(path: Path) -> str:
    """The GGUF's general.architecture ("llama", "qwen2", ...)."""
    return field(path, "general.architecture") or "unknown"


def release(reader, tensor) -> None:
    """Give back the pages of the mapped file that `tensor` was read from (its blocks are copied into the tiles'
    arrays): they count in the process's memory while mapped, and the reader stays cached. The kernel drops them
    from this process (the page cache keeps them for the next load). A no-op where madvise is missing."""
    import mmap

    mapped = getattr(reader.data, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if mapped is None or advice is None:
        return
    start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    end = -(-(tensor.data_offset + tensor.n_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        mapped.madvise(advice, start, min(end, len(mapped)) - start)
    except (OSError, ValueError):
        pass


def unreadable(path: Path) -> str | None:
    """Why read_gguf cannot take `path`'s projections (a tensor in another format, a file it cannot parse), or
    None: what --weights auto asks before it picks the blocks."""
    try:
        tensors = _reader(path).tensors
    except Exception as exc:  # gguf raises ValueError and others for a file it cannot parse
        return f"cannot read {path}: {exc}"
    return _unsupported(tensors)


def _unsupported(tensors) -> str | None:
    for tensor in tensors:
        if tensor.name.endswith(".weight") and len(tensor.shape) == 2 and tensor.tensor_type.name not in FORMATS:
            return f"{tensor.name} is {tensor.tensor_type.name}"
    return None


LOAD_THREADS = 2  # layers read (and repacked) at once


def read_gguf(path: Path, model, order: torch.Tensor, scale: float, permuted: bool | None = None,
              projections: bool = True, each=None) -> dict:
    """Read the blocks of `path` (the GGUF `model` was converted from), overwrite the model's float32
    weights with their values, and return the blocks the lean forward needs, its rows in its own order (q and
    k heads with rows reordered by `order`, q's times `scale`): {"layers": [qkv, o, gate_up, down] per layer,
    "head": the output layer, "embed": the embedding's}. A model read directly from the file (gguf_model.py: its
    weights placeholders) is left as it is, and its "embed" is a Mapped (rows decoded as they are looked up).
    permuted: whether q and k rows are in llama.cpp's order for Llama (None: whichever of the two orders the model's
    own weights match; a direct model: the file's architecture says). projections False (a direct model whose
    projections and output layer the q8 tiles' copy on disk holds: forward/repacked.py): only "embed" (a Mapped). `each`: what
    each projection and the output layer become as soon as read (a direct model's q8 tiles' copy: a load then
    holds one tensor's blocks at a time, not the model's)."""
    try:
        reader = _reader(path)
    except Exception as exc:  # gguf raises ValueError and others for a file it cannot parse
        raise CodespecError(f"--weights gguf: cannot read {path}: {exc}") from None
    if problem := _unsupported(reader.tensors):  # before any weight is overwritten
        raise CodespecError(f"--weights gguf reads {', '.join(FORMATS)} blocks; {problem}")
    tensors = {t.name: t for t in reader.tensors}
    config, inner = model.config, model.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    back = torch.argsort(order)  # lean row i of a head is the model's row order[i]
    direct = getattr(model, "gguf_direct", None) is not None
    if direct and permuted is None:
        permuted = architecture(path) == "llama"  # llama.cpp's converter permutes Llama's q and k only

    def blocks(name: str) -> Blocks:
        if name not in tensors:
            raise CodespecError(f"--weights gguf: {path.name} has no tensor {name}")
        found = Blocks.read(tensors[name])
        release(reader, tensors[name])
        return found

    def load(parameter: torch.Tensor, values: torch.Tensor, name: str) -> None:
        if direct:  # (its weights are placeholders: the blocks are the model)
            if tuple(values.shape) != tuple(parameter.shape):
                raise CodespecError(f"--weights gguf: {name} is {tuple(values.shape)}, "
                                    f"the model's {tuple(parameter.shape)}")
            return
        if tuple(values.shape) != tuple(parameter.shape):
            raise CodespecError(f"--weights gguf: {name} is {tuple(values.shape)}, "
                                f"the model's {tuple(parameter.shape)}")
        parameter.data.copy_(values)

    def heads_part(name: str, parameter: torch.Tensor, count: int) -> Blocks:
        """q or k: llama.cpp stores Llama's rotated pairs side by side (the lean order), other models as the
        model has them; whichever the file's values match is taken."""
        found = blocks(name)
        lean_rows = torch.arange(found.d.shape[0]).view(count, head_dim)[:, order].reshape(-1)
        if direct:
            load(parameter, _shaped(found, direct), name)  # (the shapes checked)
            return found if permuted else found.rows(lean_rows.numpy())
        values = found.values()
        lean_as_model = values.view(count, head_dim, -1)[:, back].reshape(values.shape)
        lean = permuted if permuted is not None else bool(
            (lean_as_model - parameter).abs().max() <= (values - parameter).abs().max())
        if lean:  # the file's rows: lean
            load(parameter, lean_as_model, name)
            return found
        load(parameter, values, name)
        return found.rows(lean_rows.numpy())

    def layer_blocks(i: int) -> list:  # layer i's [qkv, o, gate_up, down], each as `each` makes them
        layer = inner.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        q = heads_part(f"blk.{i}.attn_q.weight", attn.q_proj.weight, heads).scaled(scale)
        k = heads_part(f"blk.{i}.attn_k.weight", attn.k_proj.weight, kv_heads)
        parts = {}
        for key, name, parameter in (("v", "attn_v", attn.v_proj.weight), ("o", "attn_output", attn.o_proj.weight),
                                     ("gate", "ffn_gate", mlp.gate_proj.weight), ("up", "ffn_up", mlp.up_proj.weight),
                                     ("down", "ffn_down", mlp.down_proj.weight)):
            parts[key] = blocks(f"blk.{i}.{name}.weight")
            load(parameter, _shaped(parts[key], direct), f"blk.{i}.{name}.weight")
        fused = [Blocks.cat([q, k, parts["v"]]), parts["o"], Blocks.cat([parts["gate"], parts["up"]]), parts["down"]]
        del q, k, parts
        return [each(b) for b in fused] if each is not None else fused

    heads_only = direct and not projections  # (a model with float weights has them overwritten, always)
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    if direct:  # the embedding's rows decoded as they are looked up; the output layer where it is not kept
        if "token_embd.weight" not in tensors:
            raise CodespecError(f"--weights gguf: {path.name} has no tensor token_embd.weight")
        embed = Mapped(tensors["token_embd.weight"])
        if embed.tensor.data.shape[0] != inner.embed_tokens.weight.shape[0]:
            raise CodespecError(f"--weights gguf: token_embd.weight has {embed.tensor.data.shape[0]} rows, the "
                                f"model's vocabulary {inner.embed_tokens.weight.shape[0]}")
        if heads_only:
            return {"embed": embed}
        if each is not None and tensors[head_name].data.shape[0] != model.lm_head.weight.shape[0]:
            raise CodespecError(f"--weights gguf: {head_name} has {tensors[head_name].data.shape[0]} rows, "
                                f"the model's vocabulary {model.lm_head.weight.shape[0]}")

    def packed_head():  # (repacked from the mapped file a few thousand rows at a time)
        head = each(Mapped(tensors[head_name]))
        release(reader, tensors[head_name])
        return head

    # two at a time, the output layer with the layers: decoding and repacking the blocks is numpy and numba, which
    # let go of the GIL (a 1.7B Q4_K_M's read, 11.9-14.4 -> 7.1-7.7 s); a load holds two layers' blocks at a time,
    # not one. (Only where numba's pool is OpenMP or TBB: its workqueue takes one parallel loop at a time, and the
    # repacking has some.)
    threads = LOAD_THREADS if capabilities.host_has("openmp") else 1
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        head_packed = pool.submit(packed_head) if direct and each is not None else None
        layers = list(pool.map(layer_blocks, range(len(inner.layers))))
    if direct:
        if head_packed is not None:
            head = head_packed.result()
        else:
            head = blocks(head_name)
            load(model.lm_head.weight, _shaped(head, direct), head_name)
        return {"head": head, "embed": embed, "layers": layers}
    head = blocks(head_name)
    load(model.lm_head.weight, _shaped(head, direct), head_name)
    embed = head
    if head_name == "output.weight":  # untied: the embedding table has its own blocks
        embed = blocks("token_embd.weight")
        load(inner.embed_tokens.weight, _shaped(embed, direct), "token_embd.weight")
    return {"head": head, "embed": embed, "layers": layers}


class Mapped:
    """A tensor's blocks left in the mapped file, rows decoded when asked: an embedding table's rows as they are
    looked up (the whole table decoded held 370 MB for a 151,936-token vocabulary, and twice that while it was
    decoded; one row costs ~40 us, a forward's ids together), and an output layer repacked for the q8 tiles
    q8_tiles.REPACK_ROWS rows at a time."""

    def __init__(self, tensor):
        if tensor.tensor_type.name not in FORMATS:
            raise CodespecError(f"--weights gguf reads {', '.join(FORMATS)} blocks; {tensor.name} is "
                                f"{tensor.tensor_type.name}")
        self.tensor = tensor

    def take(self, ids) -> torch.Tensor:
        """The float32 values of rows `ids`, as Blocks.take gives them."""
        return Blocks.read(self.tensor, np.asarray(ids)).values()

    def q8_packed(self, isa: str) -> tuple:
        """Blocks.q8_packed of the whole tensor."""
        from . import q8_tiles

        source = self.tensor.tensor_type.name
        return q8_tiles.packed(KINDS[FORMATS[source][2]].bits, self.tensor.data.shape[0], lambda first, last: (
            Blocks.read(self.tensor, slice(first, last))._q8_integers(0, last - first)), isa, planes({source}))


def _shaped(blocks: Blocks, direct: bool) -> torch.Tensor:
    """The blocks' values, or for a model read directly only something of their shape (nothing is loaded)."""
    if not direct:
        return blocks.values()
    return torch.zeros(1).expand(blocks.d.shape[0], blocks.q.shape[1] * 32 // KINDS[blocks.kind].q_bytes)
