"""A prompt chunk's attention in bfloat16 dot products (AVX512-BF16), for the forward with q8 activations.

A prompt of a few thousand tokens (llama.vim's instruction: ~3,500) spends most of its prefill in attention: every
row of a 128-token chunk against every key before it. PyTorch's CPU flash attention runs that at ~134 GFLOP/s in
float32 on these 2 cores. `vdpbf16ps` multiplies 32 pairs of bfloat16 into 16 float32 sums per instruction, twice
float32's rate, and the tiles here keep it fed:

- `scores`: 4 query rows x 32 keys per step, 8 sums in registers; the keys are laid out per block of 16 so that a
  vector holds one pair of dimensions of 16 keys (no adding down across lanes), and a query's pair is broadcast
  from memory. One thread: ~220 GFLOP/s (384 rows x 3,520 keys).
- `softmax`: 16 lanes at a time over each row's own keys (the causal mask is each row's length), rounded to
  bfloat16;
- `values`: 4 rows x 64 dimensions in registers, a vector holding 16 dimensions of two consecutive keys.

Rounding: queries, keys, values and the softmax's weights are bfloat16 (8 significant bits) going into sums kept
in float32, as q8 activations round every projection's input to 8 bits; `--activations float32` keeps PyTorch's
float32 attention. Each row's result is the same whatever rows share its chunk: its sums run over its own keys in
one order (zero weights past its position add exact zeros), so the prompt's split into chunks does not matter.
"""

from __future__ import annotations

import functools
import threading

import numba
import numpy as np
import torch
from numba import prange

from .attention import _bits, _call, _widened
from .attention_ir import VECTOR, running_sums, stored_sums
from .llvmir import _exp_ir, compile_ir, splat

ROWS = 4  # query rows per tile
KEYS = 32  # keys per step of `scores` (two blocks of 16); sequences are padded to a multiple
DOT = "@llvm.x86.avx512bf16.dpbf16ps.512"
BF16 = "<32 x bfloat>"


def _broadcast(name: str, pointer: str, index: str) -> str:
    """%name = the int32 at pointer[index] (two bfloat16) in all 16 lanes, as 32 bfloat16."""
    return (f"  %{name}.p = getelementptr i32, ptr {pointer}, i64 {index}\n"
            + splat(f"{name}.b", f"%{name}.p", "<16 x i32>", "i32")
            + f"  %{name} = bitcast <16 x i32> %{name}.b to {BF16}\n")


def scores_ir(dim: int) -> str:
    """@pscores(q, width, keys, blocks, out, unused): out[r * width + j] = q[r] . k[j] for the ROWS rows of q
    ([ROWS, dim / 2] int32, each two bfloat16) and the keys of `blocks` blocks of 16 (an even count; keys
    [blocks, dim / 2, 16] int32: per block, the pair of dimensions d of its 16 keys together)."""
    pairs = dim // 2
    text = ("define void @pscores(ptr noalias %q, i64 %width, ptr noalias %k, i64 %blocks, ptr noalias %out, "
            "i64 %unused) {\nentry:\n  br label %step\nstep:\n"
            "  %b = phi i64 [ 0, %entry ], [ %b.next, %step ]\n"
            f"  %kb = mul i64 %b, {pairs * 16}\n")
    sums = {(r, j): "zeroinitializer" for r in range(ROWS) for j in range(2)}
    for d in range(pairs):
        for j in range(2):
            text += (f"  %ko{d}_{j} = add i64 %kb, {j * pairs * 16 + d * 16}\n"
                     f"  %kp{d}_{j} = getelementptr i32, ptr %k, i64 %ko{d}_{j}\n"
                     f"  %kv{d}_{j} = load {BF16}, ptr %kp{d}_{j}, align 4\n")
        for r in range(ROWS):
            text += _broadcast(f"q{d}_{r}", "%q", str(r * pairs + d))
            for j in range(2):
                name = f"%s{d}_{r}_{j}"
                text += f"  {name} = call {VECTOR} {DOT}({VECTOR} {sums[r, j]}, {BF16} %q{d}_{r}, {BF16} %kv{d}_{j})\n"
                sums[r, j] = name
    text += "  %key = mul i64 %b, 16\n"
    for r in range(ROWS):
        for j in range(2):
            text += (f"  %or{r}_{j} = mul i64 %width, {r}\n  %oj{r}_{j} = add i64 %or{r}_{j}, %key\n"
                     f"  %ok{r}_{j} = add i64 %oj{r}_{j}, {16 * j}\n"
                     f"  %op{r}_{j} = getelementptr float, ptr %out, i64 %ok{r}_{j}\n"
                     f"  store {VECTOR} {sums[r, j]}, ptr %op{r}_{j}, align 4\n")
    return text + ("  %b.next = add i64 %b, 2\n  %done = icmp uge i64 %b.next, %blocks\n"
                   "  br i1 %done, label %exit, label %step\nexit:\n  ret void\n}\n")


def values_ir(dim: int) -> str:
    """@pvalues(p, width, v, pairs, out, unused): out[r] = sum_j p[r, j] v[j] for the ROWS rows of p ([ROWS,
    width] int32: the weights of keys 2j and 2j + 1, bfloat16) over key pairs j < `pairs`, in order (v [pairs, dim]
    int32: dimension d of keys 2j and 2j + 1); out [ROWS, dim] float32."""
    chunks = dim // 16
    text = ("define void @pvalues(ptr noalias %p, i64 %width, ptr noalias %v, i64 %pairs, ptr noalias %out, "
            "i64 %unused) {\nentry:\n  %none = icmp eq i64 %pairs, 0\n  br i1 %none, label %store, label %step\n"
            "step:\n  %j = phi i64 [ 0, %entry ], [ %j.next, %step ]\n")
    text += running_sums(ROWS, chunks, "%step") + f"  %vo = mul i64 %j, {dim}\n"
    for c in range(chunks):
        text += (f"  %vo{c} = add i64 %vo, {16 * c}\n  %vp{c} = getelementptr i32, ptr %v, i64 %vo{c}\n"
                 f"  %vv{c} = load {BF16}, ptr %vp{c}, align 4\n")
    for r in range(ROWS):
        text += f"  %pr{r} = mul i64 %width, {r}\n  %pj{r} = add i64 %pr{r}, %j\n" + _broadcast(f"w{r}", "%p", f"%pj{r}")
        for c in range(chunks):
            text += f"  %a{r}_{c}.next = call {VECTOR} {DOT}({VECTOR} %a{r}_{c}, {BF16} %w{r}, {BF16} %vv{c})\n"
    text += ("  %j.next = add i64 %j, 1\n  %done = icmp eq i64 %j.next, %pairs\n"
             "  br i1 %done, label %store, label %step\nstore:\n")
    return text + stored_sums(ROWS, chunks, dim, "%step")


def softmax_ir() -> str:
    """@psoftmax(s, valid, w, width, unused, unused): w[:valid] = softmax(s[:valid]) as bfloat16, w[valid:width] =
    0 (width a multiple of 16); s[:valid] is overwritten. 16 lanes at a time, the last block masked: the row's sums
    run over its own keys only."""
    v, lanes = VECTOR, "<i64 " + ", i64 ".join(str(i) for i in range(16)) + ">"
    minus = "splat (float 0xFFF0000000000000)"

    def splat(name: str, scalar: str, kind: str, vector: str) -> str:
        return (f"  %{name}.b = insertelement {vector} poison, {kind} {scalar}, i64 0\n"
                f"  %{name} = shufflevector {vector} %{name}.b, {vector} poison, <16 x i32> zeroinitializer\n")

    def masked(name: str, index: str) -> str:  # %name.x = s[index * 16..], %name.ok = its lanes before `valid`
        return (f"  %{name}.o = mul i64 {index}, 16\n  %{name}.p = getelementptr float, ptr %s, i64 %{name}.o\n"
                f"  %{name}.x = load {v}, ptr %{name}.p, align 4\n" + splat(f"{name}.s", f"%{name}.o", "i64", "<16 x i64>")
                + f"  %{name}.l = add <16 x i64> %{name}.s, {lanes}\n"
                f"  %{name}.ok = icmp ult <16 x i64> %{name}.l, %valid.s\n")

    def loop(label: str, counter: str, start: str, body: str, after: str, phis: str = "") -> str:
        return (f"{label}:\n  %{counter} = phi i64 [ 0, {start} ], [ %{counter}.next, %{label} ]\n{phis}{body}"
                f"  %{counter}.next = add i64 %{counter}, 1\n  %{counter}.done = icmp eq i64 %{counter}.next, %blocks\n"
                f"  br i1 %{counter}.done, label %{after}, label %{label}\n")

    text = ("define void @psoftmax(ptr noalias %s, i64 %valid, ptr noalias %w, i64 %width, ptr noalias %unused, "
            "i64 %unused2) {\nentry:\n  %v15 = add i64 %valid, 15\n  %blocks = udiv i64 %v15, 16\n"
            + splat("valid.s", "%valid", "i64", "<16 x i64>") +
            "  %none = icmp eq i64 %blocks, 0\n  br i1 %none, label %fill, label %top\n")
    text += loop("top", "i", "%entry", masked("a", "%i") +
                 f"  %a.y = select <16 x i1> %a.ok, {v} %a.x, {v} {minus}\n"
                 f"  %m.next = call {v} @llvm.maxnum.v16f32({v} %m, {v} %a.y)\n", "top.end",
                 f"  %m = phi {v} [ {minus}, %entry ], [ %m.next, %top ]\n")
    text += (f"top.end:\n  %most = call float @llvm.vector.reduce.fmax.v16f32({v} %m.next)\n"
             + splat("most.s", "%most", "float", v) + "  br label %exp\n")
    text += loop("exp", "j", "%top.end", masked("b", "%j") + f"  %b.d = fsub {v} %b.x, %most.s\n" + _exp_ir("b.e", "%b.d")
                 + f"  %b.z = select <16 x i1> %b.ok, {v} %b.e, {v} zeroinitializer\n"
                 f"  store {v} %b.z, ptr %b.p, align 4\n  %t.next = fadd {v} %t, %b.z\n", "exp.end",
                 f"  %t = phi {v} [ zeroinitializer, %top.end ], [ %t.next, %exp ]\n")
    text += (f"exp.end:\n  %total = call reassoc float @llvm.vector.reduce.fadd.v16f32(float 0.0, {v} %t.next)\n"
             "  %inv = fdiv float 1.0, %total\n" + splat("inv.s", "%inv", "float", v) + "  br label %round\n")
    text += loop("round", "k", "%exp.end", "  %c.o = mul i64 %k, 16\n  %c.p = getelementptr float, ptr %s, i64 %c.o\n"
                 f"  %c.x = load {v}, ptr %c.p, align 4\n  %c.y = fmul {v} %c.x, %inv.s\n"
                 f"  %c.h = fptrunc {v} %c.y to <16 x bfloat>\n"
                 "  %c.q = getelementptr bfloat, ptr %w, i64 %c.o\n  store <16 x bfloat> %c.h, ptr %c.q, align 2\n",
                 "fill")
    return text + ("fill:\n  %from = mul i64 %blocks, 16\n  %empty = icmp uge i64 %from, %width\n"
                   "  br i1 %empty, label %exit, label %zero\n"
                   "zero:\n  %z = phi i64 [ %from, %fill ], [ %z.next, %zero ]\n"
                   "  %z.p = getelementptr bfloat, ptr %w, i64 %z\n"
                   "  store <16 x bfloat> zeroinitializer, ptr %z.p, align 2\n"
                   "  %z.next = add i64 %z, 16\n  %z.done = icmp uge i64 %z.next, %width\n"
                   "  br i1 %z.done, label %exit, label %zero\nexit:\n  ret void\n}\n")


@functools.cache
def kernels(dim: int) -> np.ndarray:
    """The addresses of @pscores, @pvalues and @psoftmax for head size `dim` (a multiple of 16), for this CPU."""
    declare = [f"{VECTOR} {DOT}({VECTOR}, {BF16}, {BF16})", f"{VECTOR} @llvm.maxnum.v16f32({VECTOR}, {VECTOR})",
               f"{VECTOR} @llvm.minnum.v16f32({VECTOR}, {VECTOR})", f"{VECTOR} @llvm.floor.v16f32({VECTOR})",
               f"float @llvm.vector.reduce.fmax.v16f32({VECTOR})",
               f"float @llvm.vector.reduce.fadd.v16f32(float, {VECTOR})"]
    source = "".join(f"declare {d}\n" for d in declare) + scores_ir(dim) + values_ir(dim) + softmax_ir()
    return compile_ir(source, ["pscores", "pvalues", "psoftmax"])


def fits(dim: int) -> bool:
    """Whether a prompt chunk of heads of size `dim` attends here: on CPUs that multiply bfloat16 pairs, for head
    sizes that are a multiple of 16."""
    return dim % 16 == 0 and available()


@functools.cache
def available() -> bool:
    """Whether this CPU multiplies bfloat16 pairs (AVX512-BF16: Zen 4, Sapphire Rapids and later)."""
    try:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        return "+avx512bf16" in llvm.get_host_cpu_features().flatten().split(",")
    except Exception:  # noqa: BLE001 - no llvmlite, or a target it does not know: PyTorch's attention instead
        return False


@numba.njit(inline="always", fastmath=True, cache=True)
def _bfloat16(x):
    """x rounded to the nearest bfloat16 (ties to even), as its 16 bits."""
    bits = np.uint32(_bits(x))
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(inline="always", fastmath=True, cache=True)
def _pair(low, high):
    """Two cache elements (float32, or float16 as its bits) as bfloat16 in one uint32, `low` in the low half."""
    return np.uint32(_bfloat16(np.float32(_widened(low)))) | (np.uint32(_bfloat16(np.float32(_widened(high)))) << 16)


@numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def _layout(keys, values, end, k, v):
    """keys and values [kv_heads, >= end, dim] (float32, or float16 as its bits) as the tiles read them: k [kv_heads,
    blocks, dim / 2, 16] and v [kv_heads, blocks * 8, dim] (uint32: two bfloat16), zero past `end`."""
    kv_heads, blocks, dim = k.shape[0], k.shape[1], keys.shape[2]
    for task in prange(kv_heads * blocks):
        h, b = task // blocks, task % blocks
        for j in range(16):
            key = b * 16 + j
            if key < end:
                for d in range(dim // 2):
                    k[h, b, d, j] = _pair(keys[h, key, 2 * d], keys[h, key, 2 * d + 1])
            else:
                k[h, b, :, j] = 0
        for p in range(b * 8, b * 8 + 8):
            if 2 * p + 1 < end:
                for d in range(dim):
                    v[h, p, d] = _pair(values[h, 2 * p, d], values[h, 2 * p + 1, d])
            elif 2 * p < end:
                for d in range(dim):
                    v[h, p, d] = _pair(values[h, 2 * p, d], values[h, 2 * p, d]) & np.uint32(0xFFFF)  # the last key alone
            else:
                v[h, p, :] = 0


@numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def _attend(q, keys, values, start, group, queries, out, scores, weights, sums, tiles):
    """Rows of q [kv_heads, padded rows, dim / 2] (int32: bfloat16 pairs; row r of KV head h is query r // group's
    head h * group + r % group, at position start + r // group) against keys [kv_heads, blocks, dim / 2, 16] and
    values [kv_heads, blocks * 8, dim] (int32, `tiles`' layouts) into out [queries, heads, dim]. Per thread:
    scores [ROWS, width] float32, weights [ROWS, width] uint16, sums [ROWS, dim] float32."""
    kv_heads, padded = q.shape[0], q.shape[1]
    dim = out.shape[2]
    per_head = padded // ROWS
    rows = queries * group
    for task in prange(kv_heads * per_head):
        h, first = task // per_head, task % per_head * ROWS
        thread = numba.get_thread_id()
        last = min(first + ROWS, rows) - 1
        seen = start + last // group + 1  # keys the tile's last row sees
        blocks = (seen + KEYS - 1) // KEYS * 2
        width = blocks * 16
        score, weight = scores[thread], weights[thread]
        _call(tiles[0], q[h, first:].ctypes.data, width, keys[h].ctypes.data, blocks, score.ctypes.data, 0)
        for r in range(ROWS):
            valid = start + (first + r) // group + 1 if first + r < rows else 0
            _call(tiles[2], score[r * width :].ctypes.data, valid, weight[r * width :].ctypes.data, width, 0, 0)
        _call(tiles[1], weight.ctypes.data, width // 2, values[h].ctypes.data, width // 2, sums[thread].ctypes.data, 0)
        for r in range(ROWS):
            if first + r < rows:
                i, g = (first + r) // group, (first + r) % group
                out[i, h * group + g, :] = sums[thread, r, :dim]


def _elements(cache: torch.Tensor) -> np.ndarray:
    """A cache layer as numba reads it: float32, or float16 as its bits."""
    return cache.view(torch.uint16).numpy() if cache.dtype == torch.float16 else cache.float().numpy()


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """x [..., even] rounded to bfloat16, as int32 pairs [..., even / 2]."""
    return x.to(torch.bfloat16).contiguous().view(torch.int32)


def _arena(words: int) -> np.ndarray:
    """A uint32 buffer of at least `words`, kept per thread and grown as needed. A fresh buffer of a megabyte or
    more is a fresh mmap (memory.py sets that threshold in the server), and its page faults made a 3,525-token
    prefill ~30% slower (3.9 -> 5.1-5.6 s)."""
    kept = getattr(_KEPT, "arena", None)
    if kept is None or kept.size < words:
        kept = _KEPT.arena = np.empty(max(words, 2 * (kept.size if kept is not None else 0)), dtype=np.uint32)
    return kept


_KEPT = threading.local()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           start: int) -> torch.Tensor:
    """As attention.attend_in_place: writes the chunk's k and v [count, kv_heads, dim] into the cache (keys, values
    [kv_heads, capacity, dim], any float dtype) at start.., then returns the causal grouped-query attention of q
    [count, heads, dim] (float32, already scaled) against it, [count, heads * dim] float32."""
    count, heads, dim = q.shape
    keys[:, start : start + count] = k.transpose(0, 1)
    values[:, start : start + count] = v.transpose(0, 1)
    kv_heads, group = keys.shape[0], heads // keys.shape[0]
    end = start + count
    padded = (end + KEYS - 1) // KEYS * KEYS
    threads = numba.get_num_threads()
    layout, scratch = kv_heads * padded * dim // 2, threads * ROWS * padded  # words: k or v; scores or weights
    arena = _arena(2 * layout + scratch + scratch // 2)
    k = arena[:layout].reshape(kv_heads, padded // 16, dim // 2, 16)
    v = arena[layout : 2 * layout].reshape(kv_heads, padded // 2, dim)
    scores = arena[2 * layout : 2 * layout + scratch].view(np.float32).reshape(threads, ROWS * padded)
    weights = arena[2 * layout + scratch : 2 * layout + scratch + scratch // 2].view(np.uint16).reshape(
        threads, ROWS * padded)
    _layout(_elements(keys), _elements(values), end, k, v)
    rows = count * group
    grouped = q.view(count, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, rows, dim)
    q_pairs = torch.zeros((kv_heads, (rows + ROWS - 1) // ROWS * ROWS, dim // 2), dtype=torch.int32)
    q_pairs[:, :rows] = _pairs(grouped)
    out = torch.empty((count, heads, dim), dtype=torch.float32)
    sums = np.empty((threads, ROWS, dim), dtype=np.float32)
    _attend(q_pairs.numpy(), k.view(np.int32), v.view(np.int32), start, group, count, out.numpy(), scores, weights,
            sums, kernels(dim))
    return out.view(count, heads * dim)
