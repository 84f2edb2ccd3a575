"""Activations rounded to 8 bits, times a GGUF's blocks in exact integers (`--activations q8`).

llama.cpp multiplies its Q4_1 and Q8_0 weights this way on CPUs: each row's inputs to a projection are rounded per
block of 32 to 8-bit integers with one float scale (its Q8_1), and a block's dot product is formed in integers.
Here:

- **Rounding** (`rounded8`): per row and block of 32, xq = rint(x * 127 / a) with a the block's largest magnitude,
  xd = a / 127 and xs = xd * sum(xq).
- **Sixteen output columns at a time.** The weights are repacked when the model loads so that one 64-byte vector
  holds four consecutive weights of each of 16 columns (for Q4_1 two such steps, as the low and high nibbles).
  One VNNI instruction (vpdpbusd) then multiplies them by four of a row's 8-bit inputs, broadcast, and adds the
  products into 16 integer sums, one per column: 64 products an instruction, no unpacking to floats and no
  horizontal sums. Per block of 32 inputs and per row, the 16 integer sums become floats once:
  out += float(sum) * (d * xd) then out += m * xs (Q4_1's w = q * d + m; Q8_0's signed q are stored plus 128,
  with m = -128 d, so both kinds are one kernel).
- **Exact and batch-invariant.** Integer sums are exact in any order, and each (row, column) then goes through the
  same float operations in the same order whichever rows share the tile (one to eight): a row's projections do not
  depend on the other rows of its forward (`tests/unit/test_q8.py`).
- d and m stay float16, as the file has them (20 bytes a Q4_1 block, against the float tiles' 24).

The rounding changes the numbers the model multiplies (as it does in llama.cpp), so the text may differ from
`--activations float32`'s; speculative and plain decoding multiply the same numbers, so their texts are identical.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import prange

from . import capabilities
from .ir import FMA_DECLARATION, splat
from .native import call, compile_ir

COLUMNS = 16  # output columns a tile computes (one 16-lane vector)
MAX_ROWS = 8  # the most rows a tile takes: each step's weights serve them all
STEP_BYTES = 64  # one step: four weights of each of 16 columns
STEPS = {"Q4_1": 4, "Q8_0": 8}  # 64-byte vectors a block of 32 weights x 16 columns takes
CHUNK_BYTES = 24 * 1024  # a thread takes as many column groups as fit in this much L1 at a time


def tile_ir(name: str, kind: str, rows: int) -> str:
    """LLVM IR of @name(x, K, q, s, g, out, N, r, xd, xs): out[r + j, 16 g .. 16 g + 15] for `rows` rows j of
    rounded inputs x [rows, K] (int8; xd, xs [rows, K / 32]) and column group g's repacked blocks (q: STEPS[kind]
    64-byte steps per block, s: per block 16 d then 16 m as float16)."""
    steps = STEPS[kind]
    block_bytes = steps * STEP_BYTES
    text = (f"define void @{name}(ptr noalias %x, i64 %K, ptr noalias %q, ptr noalias %s, i64 %g, ptr noalias %out, "
            f"i64 %N, i64 %r, ptr noalias %xd, ptr noalias %xs) {{\nentry:\n  %blocks = udiv i64 %K, 32\n"
            f"  %gb = mul i64 %g, %blocks\n")
    for j in range(rows):
        text += (f"  %r{j} = add i64 %r, {j}\n  %xo{j} = mul i64 %r{j}, %K\n"
                 f"  %x{j} = getelementptr i8, ptr %x, i64 %xo{j}\n  %bo{j} = mul i64 %r{j}, %blocks\n"
                 f"  %xd{j} = getelementptr float, ptr %xd, i64 %bo{j}\n"
                 f"  %xs{j} = getelementptr float, ptr %xs, i64 %bo{j}\n")
    text += "  br label %loop\nloop:\n  %b = phi i64 [ 0, %entry ], [ %b.next, %loop ]\n"
    for j in range(rows):
        text += f"  %a{j} = phi <16 x float> [ zeroinitializer, %entry ], [ %a{j}.next, %loop ]\n"
    text += (f"  %gbb = add i64 %gb, %b\n  %qo = mul i64 %gbb, {block_bytes}\n"
             f"  %qp = getelementptr i8, ptr %q, i64 %qo\n")
    weights = []  # (step, vector name) for the block's 8 steps of 4 weights
    for p in range(steps):
        text += (f"  %qp{p} = getelementptr i8, ptr %qp, i64 {p * STEP_BYTES}\n"
                 f"  %qv{p} = load <64 x i8>, ptr %qp{p}, align 1\n")
        if kind == "Q4_1":  # step p in the low nibbles, step p + 4 in the high ones
            text += (f"  %w{p} = and <64 x i8> %qv{p}, splat (i8 15)\n"
                     f"  %w{p + 4} = lshr <64 x i8> %qv{p}, splat (i8 4)\n")
            weights += [(p, f"%w{p}"), (p + 4, f"%w{p + 4}")]
        else:
            weights.append((p, f"%qv{p}"))
    text += (f"  %so = mul i64 %gbb, 32\n  %sp = getelementptr half, ptr %s, i64 %so\n"
             f"  %dh = load <16 x half>, ptr %sp, align 2\n  %d = fpext <16 x half> %dh to <16 x float>\n"
             f"  %mp = getelementptr half, ptr %sp, i64 16\n  %mh = load <16 x half>, ptr %mp, align 2\n"
             f"  %m = fpext <16 x half> %mh to <16 x float>\n  %xb = mul i64 %b, 32\n")
    for j in range(rows):
        chains = {0: "zeroinitializer", 1: "zeroinitializer"}  # two independent integer sums (exact in any order)
        for step, vector in sorted(weights):
            chain = step // 4
            text += (f"  %xo{j}_{step} = add i64 %xb, {4 * step}\n"
                     f"  %xp{j}_{step} = getelementptr i8, ptr %x{j}, i64 %xo{j}_{step}\n")
            text += splat(f"xi{j}_{step}", f"%xp{j}_{step}", "<16 x i32>", "i32")
            text += (f"  %xv{j}_{step} = bitcast <16 x i32> %xi{j}_{step} to <64 x i8>\n"
                     f"  %c{j}_{step} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {chains[chain]}, "
                     f"<64 x i8> {vector}, <64 x i8> %xv{j}_{step})\n")
            chains[chain] = f"%c{j}_{step}"
        text += (f"  %ci{j} = add <16 x i32> {chains[0]}, {chains[1]}\n"
                 f"  %cf{j} = sitofp <16 x i32> %ci{j} to <16 x float>\n"
                 f"  %xdp{j} = getelementptr float, ptr %xd{j}, i64 %b\n")
        text += splat(f"xdv{j}", f"%xdp{j}", "<16 x float>", "float")
        text += (f"  %sc{j} = fmul <16 x float> %d, %xdv{j}\n"
                 f"  %t{j} = call <16 x float> @llvm.fma.v16f32(<16 x float> %cf{j}, <16 x float> %sc{j}, "
                 f"<16 x float> %a{j})\n  %xsp{j} = getelementptr float, ptr %xs{j}, i64 %b\n")
        text += splat(f"xsv{j}", f"%xsp{j}", "<16 x float>", "float")
        text += (f"  %a{j}.next = call <16 x float> @llvm.fma.v16f32(<16 x float> %m, <16 x float> %xsv{j}, "
                 f"<16 x float> %t{j})\n")
    text += ("  %b.next = add i64 %b, 1\n  %done = icmp eq i64 %b.next, %blocks\n"
             "  br i1 %done, label %end, label %loop\nend:\n  %col = mul i64 %g, 16\n")
    for j in range(rows):
        text += (f"  %oo{j} = mul i64 %r{j}, %N\n  %oi{j} = add i64 %oo{j}, %col\n"
                 f"  %op{j} = getelementptr float, ptr %out, i64 %oi{j}\n"
                 f"  store <16 x float> %a{j}.next, ptr %op{j}, align 4\n")
    return text + "  ret void\n}\n"


DECLARATIONS = (FMA_DECLARATION + "declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <64 x i8>, <64 x i8>)\n")


def available() -> bool:
    """Whether this CPU has the 512-bit VNNI instructions the tiles use (capabilities.py)."""
    return capabilities.available("q8 block tiles")


def source(kind: str) -> tuple[str, list[str]]:
    """The IR module of `kind`'s tiles for 1..MAX_ROWS rows and their names."""
    names = [f"q8_{kind.lower()}_{rows}" for rows in range(1, MAX_ROWS + 1)]
    return DECLARATIONS + "".join(tile_ir(name, kind, rows)
                                  for name, rows in zip(names, range(1, MAX_ROWS + 1))), names


@functools.cache
def tiles(kind: str) -> np.ndarray:
    """The addresses of `kind`'s tiles for 1..MAX_ROWS rows (entry i takes i + 1 rows), compiled for this CPU."""
    return compile_ir(*source(kind), "q8 block tiles")


@numba.njit(cache=True, boundscheck=False)  # no fastmath: 127 / a rounds as written
def _round_row(x, r, xq, xd, xs):
    """Row r of x rounded to 8 bits per block of 32 into xq, xd and xs (see rounded8)."""
    for b in range(xd.shape[1]):
        top = np.float32(0.0)
        for i in range(b * 32, b * 32 + 32):
            top = max(top, abs(x[r, i]))
        inverse = np.float32(127.0) / top if top > 0 else np.float32(0.0)
        total = 0
        for i in range(b * 32, b * 32 + 32):
            value = np.int32(np.rint(x[r, i] * inverse))
            xq[r, i] = value
            total += value
        xd[r, b] = top / np.float32(127.0)
        xs[r, b] = xd[r, b] * np.float32(total)


PARALLEL_ROWS = 8  # from this many rows, rows are rounded in parallel


@numba.njit(parallel=True, cache=True, boundscheck=False)
def rounded8(x):
    """x [rows, K] rounded to 8 bits per block of 32: xq (int8), xd = a / 127 and xs = xd * sum(xq) [rows, K / 32],
    where a is the block's largest magnitude and xq = rint(x * 127 / a)."""
    rows, size = x.shape
    xq = np.empty((rows, size), dtype=np.int8)
    xd = np.empty((rows, size // 32), dtype=np.float32)
    xs = np.empty((rows, size // 32), dtype=np.float32)
    if rows >= PARALLEL_ROWS:
        for r in prange(rows):
            _round_row(x, r, xq, xd, xs)
    else:  # a parallel region costs more than a few rows
        for r in range(rows):
            _round_row(x, r, xq, xd, xs)
    return xq, xd, xs


@numba.njit(parallel=True, cache=True, boundscheck=False)
def linear(x, weight):
    """x [rows, K] (float32, contiguous) times the repacked weight (q, s, tiles, N, groups a chunk): [rows, N]."""
    q, s, tile, outputs, chunk_groups = weight
    xq, xd, xs = rounded8(x)
    rows, size = x.shape
    groups = q.shape[0]
    out = np.empty((rows, groups * COLUMNS), dtype=np.float32)
    for chunk in prange((groups + chunk_groups - 1) // chunk_groups):
        # the addresses are taken here, in the loop: taken before it, numba may free the arrays once they are read
        X, Q, S, O, XD, XS = xq.ctypes.data, q.ctypes.data, s.ctypes.data, out.ctypes.data, xd.ctypes.data, \
            xs.ctypes.data
        r = 0
        while r < rows:
            take = min(MAX_ROWS, rows - r)
            for g in range(chunk * chunk_groups, min(groups, chunk * chunk_groups + chunk_groups)):
                call(tile[take - 1], X, size, Q, S, g, O, groups * COLUMNS, r, XD, XS)
            r += take
    if outputs == groups * COLUMNS:
        return out
    return np.ascontiguousarray(out[:, :outputs])


def repack(kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple:
    """A GGUF tensor's blocks (block_tiles.Blocks' q, d, m: [N, ...]) as `linear` takes them. Columns are padded to a
    multiple of 16 with zero weights."""
    n, blocks = d.shape
    if kind == "Q4_1":  # byte i of a block: weight i (low nibble), weight 16 + i (high)
        values = np.concatenate([q.reshape(n, blocks, 16) & 15, q.reshape(n, blocks, 16) >> 4], axis=2)
        minimum = m
    else:  # signed bytes stored plus 128 (unsigned, as vpdpbusd takes them): w = (q + 128) d - 128 d
        values = (q.view(np.int8).reshape(n, blocks, 32).astype(np.int16) + 128).astype(np.uint8)
        minimum = -128 * d
    groups = -(-n // COLUMNS)
    padded = groups * COLUMNS
    values = np.concatenate([values, np.zeros((padded - n, blocks, 32), np.uint8)]).astype(np.uint8)
    scales = np.zeros((padded, blocks, 2), np.float16)
    scales[:n, :, 0], scales[:n, :, 1] = d, minimum
    if not (np.array_equal(scales[:n, :, 0].astype(np.float32), d)
            and np.array_equal(scales[:n, :, 1].astype(np.float32), minimum)):
        raise ValueError("the scales are not float16 values")
    # [group, column, block, step, 4 weights] -> [group, block, step, column, 4 weights]
    steps = values.reshape(groups, COLUMNS, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
    if kind == "Q4_1":  # step p (low nibble) with step p + 4 (high nibble)
        packed = steps[:, :, :4] | (steps[:, :, 4:] << 4)
    else:
        packed = steps
    packed = np.ascontiguousarray(packed).reshape(groups, -1)
    s = np.ascontiguousarray(scales.reshape(groups, COLUMNS, blocks, 2).transpose(0, 2, 3, 1)).reshape(groups, -1)
    group_bytes = packed.shape[1] + s.nbytes // groups
    return (packed, s.view(np.uint16), tiles(kind), n, max(1, CHUNK_BYTES // group_bytes))
