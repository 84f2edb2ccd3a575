"""The graph-safe forward's operations as fused Triton kernels for GPUs: `TritonOps`, graph_ops.TorchOps' interface.

Launches. A decoder layer is 10 kernels, where PyTorch's ops take ~25:

    add_norm (the residual add with the attention norm; the first layer: norm), linear qkv, rotate_and_store,
    attend (2: the splits, then their combination), linear o, add_norm, linear gate_up, silu_mul, linear down.

Batch invariance. All sessions' rows run stacked in one forward (B sessions x `width` rows), and a row's bits must
not depend on how many other rows or sessions the launch holds or what they hold: then a token decoded alone,
verified in a draft or stacked with other sessions gets the same logits, and greedy speculation stays lossless.
Every kernel here keeps that by construction:

- the row-wise kernels (norm, add_norm, rotate_and_store, silu_mul) give each row its own program, whose shapes
  depend on the model's sizes only;
- `linear` tiles the output in fixed blocks (BLOCK_M rows x BLOCK_N columns) and walks K in fixed BLOCK_K steps in
  order, accumulating in float32, with no split-K and no autotuning: a row's dot products are the same
  instructions in the same order whatever M is (the rows of a tile never mix in a matrix product). The tile
  shapes depend on the dtype only;
- `attend` cuts the keys into splits at fixed absolute positions (SPLIT keys each: split s holds keys
  s*SPLIT .. (s+1)*SPLIT - 1, whatever the session's start or the pool's length). A program per (session, KV
  head, split) runs an online softmax over BLOCK_N-key blocks in order for all the session's rows of that head's
  query group (they share the key loads), and a second kernel combines, per row and head, exactly the splits that
  hold keys at or before that row's position, in split order. Within a split, a block past a row's position (the
  program reads up to its session's last row) is an exact no-op for that row: its scores are -inf, so its weights
  are exp2(-inf) = 0 and the rescaling factor exp2(m - m) = 1, leaving the row's max, sum and accumulator the same
  bits (the block's keys and values are ones this forward has just written: finite). Splits past a row's
  position are never read for it. So a row's result depends only on its own query, position and cache: not on B,
  not on the other sessions, not on the other rows of its own session (their positions or contents).
  Keys past a session's last row are never read: blocks and splits past it are skipped.

Precision policy. Everything accumulates in float32. float32 inputs multiply with tl.dot(input_precision="ieee"):
no TF32, which would round the inputs to 10-bit mantissas and lose what float32 weights are for (and differ from
the CPU's float32 forward far more than float rounding). bfloat16 and float16 inputs multiply on tensor cores
with float32 accumulation; attention's softmax weights are rounded to the values' dtype for their product, as
graph_ops.TorchOps does. Results are cast to the input's dtype.

This is the only module that imports triton (graph_ops.choose_ops imports it lazily, on CUDA). Its tests run the
kernels in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows of a linear's output tile: the smallest a tensor-core dot takes, and the forward's width
BLOCK_N = 32  # columns of a linear's output tile: small, so that a decoding forward of 16 rows still has
# N / 32 programs to spread a layer's weights over the GPU's cores (split-K would add more, but varies the sums)
BLOCK_K = {torch.float32: 32, torch.bfloat16: 64, torch.float16: 64}  # a linear's K step (float32: half the
# elements for the same bytes)
SPLIT = 256  # keys per attention split: a constant, so splits sit at the same absolute positions in every launch
ATTEND_BLOCK_N = 32  # keys per online-softmax step within a split (a divisor of SPLIT)
ROW_BLOCK = 1024  # elements per program of silu_mul


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact float32 products for float32 (no TF32); the tensor cores' own otherwise
    ("tf32" is Triton's default, which it ignores for 16-bit inputs)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def _warps(elements: int) -> int:
    """Warps for a program over `elements` (a power of two): a function of the model's sizes only, never of the
    row count (a reduction's order follows the warps)."""
    return max(1, min(16, elements // 256))


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count (Triton specialises integers
# that are 1 or multiples of 16 otherwise)
def _linear_kernel(x, w, bias, out, M, N, K, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    # axis 0 walks the row blocks, so that programs sharing a weight tile run side by side (it is read once from
    # memory, then from L2)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):  # in order, the whole of K: no split-K
        k_ok = (k0 + ks) < K
        a = tl.load(x + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        # the weight tile read transposed, [BK, BN], from weight [N, K]
        b = tl.load(w + cols[None, :] * stride_wn + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rows[:, None] * stride_om + cols[None, :], acc.to(out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _norm_kernel(x, delta, weight, summed, normed, H, eps, stride_x, stride_d, stride_s, stride_n,
                 ADD: tl.constexpr, BH: tl.constexpr):
    # one row per program; with ADD, the residual add first, rounded to the stream's dtype as it is stored, and
    # the norm of that rounded sum (what a separate add, then norm, would compute)
    row = tl.program_id(0)
    cols = tl.arange(0, BH)
    ok = cols < H
    v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        d = tl.load(delta + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
        s = (v + d).to(summed.dtype.element_ty)
        tl.store(summed + row * stride_s + cols, s, mask=ok)
        v = s.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
    g = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(normed + row * stride_n + cols, (v * inverse * g).to(normed.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_kernel(qkv, cos, sin, positions, slots, keys, values, q_out, qk_norm, eps, stride_qkv, stride_cos,
                   stride_ks, stride_kh, stride_kp, stride_vs, stride_vh, stride_vp,
                   HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HAS_NORM: tl.constexpr,
                   BHEADS: tl.constexpr, BHALF: tl.constexpr):
    # one row per program: all its heads as a [heads + 2 kv_heads, dim / 2] tile of pairs (2i, 2i + 1)
    m = tl.program_id(0)
    position = tl.load(positions + m)
    slot = tl.load(slots + m)
    h = tl.arange(0, BHEADS)[:, None]  # the head: q heads, then k heads, then v heads
    i = tl.arange(0, BHALF)[None, :]  # the pair
    ok = (h < HEADS + 2 * KV_HEADS) & (i < DIM // 2)
    source = qkv + m * stride_qkv + h * DIM + 2 * i
    a = tl.load(source, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(source + 1, mask=ok, other=0.0).to(tl.float32)
    turns = h < HEADS + KV_HEADS  # q and k heads turn; v heads are stored as they are
    if HAS_NORM:  # Qwen3's per-head norms of q and k, before turning (padding pairs load 0: they add nothing)
        inverse = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1))[:, None] / DIM + eps)
        g = qk_norm + h * DIM + 2 * i
        g_ok = ok & turns
        ga = tl.load(g, mask=g_ok, other=1.0).to(tl.float32)
        gb = tl.load(g + 1, mask=g_ok, other=1.0).to(tl.float32)
        a = tl.where(turns, a * inverse * ga, a)
        b = tl.where(turns, b * inverse * gb, b)
    c = tl.load(cos + position * stride_cos + i, mask=i < DIM // 2, other=1.0)
    s = tl.load(sin + position * stride_cos + i, mask=i < DIM // 2, other=0.0)
    ta = tl.where(turns, a * c - b * s, a)
    tb = tl.where(turns, a * s + b * c, b)
    # q heads to q_out [M, heads, dim]
    is_q = ok & (h < HEADS)
    target = q_out + (m * HEADS + h) * DIM + 2 * i
    tl.store(target, ta.to(q_out.dtype.element_ty), mask=is_q)
    tl.store(target + 1, tb.to(q_out.dtype.element_ty), mask=is_q)
    # k heads to keys[slot, h - heads, position] (the head index clamped at 0 where masked off: no negative offsets)
    is_k = ok & (h >= HEADS) & turns
    kh = tl.maximum(h - HEADS, 0)
    target = keys + slot * stride_ks + kh * stride_kh + position * stride_kp + 2 * i
    tl.store(target, ta.to(keys.dtype.element_ty), mask=is_k)
    tl.store(target + 1, tb.to(keys.dtype.element_ty), mask=is_k)
    # v heads to values[slot, h - heads - kv_heads, position]
    is_v = ok & (h >= HEADS + KV_HEADS)
    vh = tl.maximum(h - HEADS - KV_HEADS, 0)
    target = values + slot * stride_vs + vh * stride_vh + position * stride_vp + 2 * i
    tl.store(target, ta.to(values.dtype.element_ty), mask=is_v)
    tl.store(target + 1, tb.to(values.dtype.element_ty), mask=is_v)


@triton.jit
def _silu_mul_kernel(gate_up, out, F, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    g = tl.load(gate_up + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * stride_g + F + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(out.dtype.element_ty), mask=ok)


@triton.jit
def _attend_split_kernel(q, keys, values, slots, starts, part_m, part_l, part_acc, length,
                         stride_qm, stride_qh, stride_ks, stride_kh, stride_kp, stride_vs, stride_vh, stride_vp,
                         HEADS: tl.constexpr, GROUP: tl.constexpr, WIDTH: tl.constexpr, DIM: tl.constexpr,
                         SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BROWS: tl.constexpr, BDIM: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(starts + b)
    slot = tl.load(slots + b)
    first = split * SPLIT_KEYS  # the split's keys sit at fixed absolute positions
    last = start + WIDTH - 1  # the session's last row position: no key past it is read
    if first <= last:
        # the tile's rows: j = r * GROUP + g is row r of the session under the group's query head g
        j = tl.arange(0, BROWS)
        r, g = j // GROUP, j % GROUP
        row_ok = j < WIDTH * GROUP
        d = tl.arange(0, BDIM)
        d_ok = d < DIM
        row = b * WIDTH + r
        head = kv_head * GROUP + g
        qt = tl.load(q + row[:, None] * stride_qm + head[:, None] * stride_qh + d[None, :],
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        position = start + r  # each row's own position: it sees keys 0..position
        end = tl.minimum(tl.minimum(first + SPLIT_KEYS, last + 1), length)
        m_i = tl.full([BROWS], float("-inf"), tl.float32)  # running max of the scores (log2 units)
        l_i = tl.zeros([BROWS], tl.float32)  # running sum of exp2(score - max)
        acc = tl.zeros([BROWS, BDIM], tl.float32)
        k_base = keys + slot * stride_ks + kv_head * stride_kh
        v_base = values + slot * stride_vs + kv_head * stride_vh
        for n0 in range(first, end, BLOCK_N):  # in order
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            kt = tl.load(k_base + n[None, :] * stride_kp + d[:, None], mask=d_ok[:, None] & n_ok[None, :],
                         other=0.0)  # [BDIM, BLOCK_N]
            scores = tl.dot(qt, kt, input_precision=PRECISION) * 1.4426950408889634  # log2(e): exp2 below
            scores = tl.where(n[None, :] <= position[:, None], scores, float("-inf"))  # causal, and padding
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # a row with no key yet (only past its position) keeps max -inf: subtract 0 there, not -inf (NaN)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)  # exactly 1 where the max did not move
            p = tl.exp2(scores - m_safe[:, None])  # exactly 0 past the row's position
            vt = tl.load(v_base + n[:, None] * stride_vp + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                         other=0.0)  # [BLOCK_N, BDIM]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            m_i = m_new
        # partials [B * width, heads, SPLITS] (and [.., DIM] for the accumulator), read back per row and head
        index = (row * HEADS + head) * SPLITS + split
        tl.store(part_m + index, m_i, mask=row_ok)
        tl.store(part_l + index, l_i, mask=row_ok)
        tl.store(part_acc + index[:, None] * DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _attend_combine_kernel(starts, part_m, part_l, part_acc, out, stride_om,
                           HEADS: tl.constexpr, WIDTH: tl.constexpr, DIM: tl.constexpr, SPLITS: tl.constexpr,
                           SPLIT_KEYS: tl.constexpr, BDIM: tl.constexpr):
    # one (row, head) per program: the splits that hold keys at or before the row's position, in order; split 0
    # always does (position >= 0), so it seeds the max and the sums
    row = tl.program_id(0)
    head = tl.program_id(1)
    position = tl.load(starts + row // WIDTH) + row % WIDTH
    count = position // SPLIT_KEYS + 1
    base = (row * HEADS + head) * SPLITS
    d = tl.arange(0, BDIM)
    d_ok = d < DIM
    top = tl.load(part_m + base)
    for s in range(1, count):
        top = tl.maximum(top, tl.load(part_m + base + s))
    weight = tl.exp2(tl.load(part_m + base) - top)
    total = weight * tl.load(part_l + base)
    acc = weight * tl.load(part_acc + base * DIM + d, mask=d_ok, other=0.0)
    for s in range(1, count):
        weight = tl.exp2(tl.load(part_m + base + s) - top)
        total += weight * tl.load(part_l + base + s)
        acc += weight * tl.load(part_acc + (base + s) * DIM + d, mask=d_ok, other=0.0)
    tl.store(out + row * stride_om + head * DIM + d, (acc / total).to(out.dtype.element_ty), mask=d_ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along its last dimension (the kernels index it so)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonOps:
    """graph_ops.TorchOps' operations in fused Triton kernels (CUDA; CPU tensors in Triton's interpreter)."""

    name = "triton"

    def __init__(self, split: int = SPLIT):
        if split % ATTEND_BLOCK_N:
            raise ValueError(f"an attention split ({split}) must be a multiple of {ATTEND_BLOCK_N} keys")
        self.split = split

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x.dtype, float32 sums in fixed tiles."""
        x, weight = _rows(x), _rows(weight)
        (M, K), N = x.shape, weight.shape[0]
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _linear_kernel[grid](x, weight, bias if bias is not None else x, out, M, N, K, x.stride(0),
                             weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BM=BLOCK_M, BN=BLOCK_N,
                             BK=BLOCK_K[x.dtype], PRECISION=_precision(x.dtype), num_warps=4)
        return out

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x) * weight over the last dimension, computed in float32."""
        x = _rows(x)
        normed = torch.empty_like(x)
        H = x.shape[-1]
        _norm_kernel[(x.shape[0],)](x, x, weight, x, normed, H, eps, x.stride(0), 0, 0, normed.stride(0),
                                    ADD=False, BH=_pow2(H), num_warps=_warps(_pow2(H)))
        return normed

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
        """(x + delta, rms_norm(x + delta) * weight): the residual add fused with the next norm (new tensors)."""
        x, delta = _rows(x), _rows(delta)
        summed, normed = torch.empty_like(x), torch.empty_like(x)
        H = x.shape[-1]
        _norm_kernel[(x.shape[0],)](x, delta, weight, summed, normed, H, eps, x.stride(0), delta.stride(0),
                                    summed.stride(0), normed.stride(0), ADD=True, BH=_pow2(H),
                                    num_warps=_warps(_pow2(H)))
        return summed, normed

    def rotate_and_store(self, qkv, cos, sin, positions, slots, keys, values, heads: int, kv_heads: int,
                         qk_norm, eps: float) -> torch.Tensor:
        """Each row's q and k heads normed (qk_norm [heads + kv_heads, dim], or None) and turned by its position's
        angles, in float32; its k and v heads written to keys/values[slots[m], :, positions[m]]. Returns the
        turned q heads [M, heads, dim] in qkv.dtype."""
        qkv = _rows(qkv)
        rows, dim = qkv.shape[0], keys.shape[-1]
        assert qkv.shape[1] == (heads + 2 * kv_heads) * dim and dim % 2 == 0
        assert keys.stride(-1) == 1 and values.stride(-1) == 1 and cos.stride() == sin.stride()
        q_out = torch.empty((rows, heads, dim), dtype=qkv.dtype, device=qkv.device)
        if qk_norm is not None:
            qk_norm = qk_norm.expand(heads + kv_heads, dim).contiguous()
        _rotate_kernel[(rows,)](qkv, cos, sin, positions, slots, keys, values, q_out,
                                qk_norm if qk_norm is not None else qkv, eps, qkv.stride(0), cos.stride(0),
                                *keys.stride()[:3], *values.stride()[:3], HEADS=heads, KV_HEADS=kv_heads, DIM=dim,
                                HAS_NORM=qk_norm is not None, BHEADS=_pow2(heads + 2 * kv_heads),
                                BHALF=_pow2(dim // 2), num_warps=4)
        return q_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of [M, 2F] -> [M, F], computed in float32."""
        gate_up = _rows(gate_up)
        rows, F = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, F), dtype=gate_up.dtype, device=gate_up.device)
        _silu_mul_kernel[(rows, triton.cdiv(F, ROW_BLOCK))](gate_up, out, F, gate_up.stride(0), out.stride(0),
                                                            BLOCK=ROW_BLOCK, num_warps=4)
        return out

    def attend(self, q, keys, values, slots, starts, width: int, split: int | None = None) -> torch.Tensor:
        """Session b's `width` rows q[b * width:][:width] (pre-scaled, at positions starts[b]..) attend causally to
        slot slots[b] of keys/values [slots, kv_heads, length, dim]: softmax(q k^T) v as [B * width, heads * dim]
        in q.dtype, in two launches (fixed splits, then their combination; see the module's docstring)."""
        split = split or self.split
        assert split % ATTEND_BLOCK_N == 0
        q = _rows(q)
        rows, heads, dim = q.shape
        sessions, kv_heads, length = slots.shape[0], keys.shape[1], keys.shape[2]
        assert rows == sessions * width and heads % kv_heads == 0
        assert keys.stride(-1) == 1 and values.stride(-1) == 1
        group = heads // kv_heads
        splits = triton.cdiv(length, split)
        part_m = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((rows, heads, splits, dim), dtype=torch.float32, device=q.device)
        brows = max(16, _pow2(width * group))  # a dot's rows: 16 at least
        bdim = max(16, _pow2(dim))
        _attend_split_kernel[(sessions, kv_heads, splits)](
            q, keys, values, slots, starts, part_m, part_l, part_acc, length, q.stride(0), q.stride(1),
            *keys.stride()[:3], *values.stride()[:3], HEADS=heads, GROUP=group, WIDTH=width, DIM=dim, SPLITS=splits,
            SPLIT_KEYS=split, BLOCK_N=ATTEND_BLOCK_N, BROWS=brows, BDIM=bdim, PRECISION=_precision(q.dtype),
            num_warps=8 if brows * bdim >= 128 * 128 else 4)  # (the query tile and accumulator in registers)
        out = torch.empty((rows, heads * dim), dtype=q.dtype, device=q.device)
        _attend_combine_kernel[(rows, heads)](starts, part_m, part_l, part_acc, out, out.stride(0), HEADS=heads,
                                              WIDTH=width, DIM=dim, SPLITS=splits, SPLIT_KEYS=split, BDIM=bdim,
                                              num_warps=1)
        return out
