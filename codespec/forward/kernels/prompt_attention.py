"""A prompt chunk's attention in bfloat16 dot products (AVX512-BF16), for the forward with q8 activations.

A prompt of a few thousand tokens (llama.vim's instruction: ~3,500) spends most of its prefill in attention: every
row of a 128-token chunk against every key before it. PyTorch's CPU flash attention runs that at ~134 GFLOP/s in
float32 on these 2 cores. `vdpbf16ps` multiplies 32 pairs of bfloat16 into 16 float32 sums per instruction, twice
float32's rate, and the tiles here keep it fed:

- `scores`: 4 query rows x 32 keys per step, 8 sums in registers; the keys are laid out per block of 16 so that a
  vector holds one pair of dimensions of 16 keys (no adding down across lanes), and a query's pair is broadcast
  from memory. One thread: ~220 GFLOP/s (384 rows x 3,520 keys).
- `softmax`: 16 lanes at a time over each row's own keys (the causal mask is each row's length): the maximum,
  then exp(score - max) rounded to bfloat16 and summed; `values`' sums are divided by that sum once per row;
- `values`: 4 rows x 64 dimensions in registers, a vector holding 16 dimensions of two consecutive keys.

Rounding: queries, keys, values and the softmax's weights are bfloat16 (8 significant bits) going into sums kept
in float32, as q8 activations round every projection's input to 8 bits; `--activations float32` keeps PyTorch's
float32 attention. Each row's result is the same whatever rows share its chunk: its sums run over its own keys in
one order (zero weights past its position add exact zeros), so the prompt's split into chunks does not matter.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from numba import prange

from .attention import _bits, _widened, _write, elements
from . import capabilities
from .ir import EXP_DECLARATIONS, SOFTMAX_DECLARATIONS, VECTOR, running_sums, softmax_ir, splat, stored_sums
from .native import call, compile_ir

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


NAMES = ["pscores", "pvalues", "psoftmax"]


@functools.cache
def kernels(dim: int) -> np.ndarray:
    """The addresses of @pscores, @pvalues and @psoftmax for head size `dim` (a multiple of 16), for this CPU."""
    return compile_ir(source(dim), NAMES, "prompt attention")


def source(dim: int) -> str:
    """The IR module of the three tiles for head size `dim`."""
    return (EXP_DECLARATIONS + SOFTMAX_DECLARATIONS + f"declare {VECTOR} {DOT}({VECTOR}, {BF16}, {BF16})\n"
            + scores_ir(dim) + values_ir(dim) + softmax_ir("psoftmax", bfloat16=True))


def fits(dim: int) -> bool:
    """Whether a prompt chunk of heads of size `dim` attends here: on CPUs that multiply bfloat16 pairs, for head
    sizes that are a multiple of 16."""
    return dim % 16 == 0 and available()


def available() -> bool:
    """Whether this CPU multiplies bfloat16 pairs (AVX512-BF16: Zen 4, Sapphire Rapids and later; capabilities.py)."""
    return capabilities.available("prompt attention")


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
def _layout(keys, values, first, end, padded, k, v):
    """Positions first.. (a multiple of 16) up to `padded` of keys and values [kv_heads, >= end, dim] (float32, or
    float16 as its bits) as the tiles read them, into k [kv_heads, blocks, dim / 2, 16] and v [kv_heads, blocks * 8,
    dim] (uint32: two bfloat16), zero from `end` on."""
    kv_heads, dim = k.shape[0], keys.shape[2]
    blocks = (padded - first) // 16
    for task in prange(kv_heads * blocks):
        h, b = task // blocks, first // 16 + task % blocks
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


class Laid:
    """A cache's keys and values in the tiles' layouts, every layer, kept while a prompt's chunks run: a chunk lays
    out its own keys and whatever the cache changed since (`changed`), not every key before it again (~0.2 s of a
    3,525-token prefill). As many bytes as a float16 cache; forward.StaticCache drops it once its session decodes."""

    def __init__(self, layers: int, kv_heads: int, capacity: int, dim: int):
        capacity = (capacity + KEYS - 1) // KEYS * KEYS
        self.k = np.empty((layers, kv_heads, capacity // 16, dim // 2, 16), dtype=np.uint32)
        self.v = np.empty((layers, kv_heads, capacity // 2, dim), dtype=np.uint32)
        self.laid = [0] * layers  # per layer: positions 0.. laid out as the cache holds them

    @property
    def capacity(self) -> int:
        return self.v.shape[2] * 2

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def changed(self, position: int) -> None:
        """The cache's keys and values from `position` on may differ from what was laid out."""
        self.laid = [min(laid, position) for laid in self.laid]


@numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def _attend(q, keys, values, start, group, queries, out, scores, weights, sums, inverses, tiles):
    """Rows of q [kv_heads, padded rows, dim / 2] (uint32: bfloat16 pairs; row r of KV head h is query r // group's
    head h * group + r % group, at position start + r // group) against keys [kv_heads, blocks, dim / 2, 16] and
    values [kv_heads, blocks * 8, dim] (uint32, `tiles`' layouts) into out [queries, heads, dim]. Per thread:
    scores [ROWS, width] float32, weights [ROWS, width] uint16, sums [ROWS, dim] and inverses [ROWS] float32."""
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
        score, weight, inverse = scores[thread], weights[thread], inverses[thread]
        call(tiles[0], q[h, first:].ctypes.data, width, keys[h].ctypes.data, blocks, score.ctypes.data, 0)
        for r in range(ROWS):
            valid = start + (first + r) // group + 1 if first + r < rows else 0
            call(tiles[2], score[r * width :].ctypes.data, valid, weight[r * width :].ctypes.data, width,
                  inverse[r:].ctypes.data, 0)
        call(tiles[1], weight.ctypes.data, width // 2, values[h].ctypes.data, width // 2, sums[thread].ctypes.data, 0)
        for r in range(ROWS):
            if first + r < rows:
                i, g = (first + r) // group, (first + r) % group
                out[i, h * group + g, :] = sums[thread, r, :dim] * inverse[r]


def _elements(cache: torch.Tensor) -> np.ndarray:
    """A cache layer as numba reads and writes it: float32, or float16 as its bits."""
    if cache.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"the tiles take float16 or float32 caches, not {cache.dtype}")
    return elements(cache)


@numba.njit(fastmath=False, parallel=True, cache=True, boundscheck=False)
def _chunk(q, k, v, keys, values, start, write, laid_k, laid_v, laid_from, out, tiles, threads):
    """`attend` in one call: the chunk's keys and values into the cache (when `write`), the cache laid out from
    laid_from on, the queries as bfloat16 pairs grouped by KV head, the tiles into out [count, heads, dim] (scratch
    for `threads` threads: numba.get_num_threads() here would keep numba from caching the function)."""
    count, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    if write:  # as the decoding kernel writes them: rounded as PyTorch assigns float32 to the cache's dtype
        for h in prange(kv_heads):
            _write(keys[h].ctypes.data, values[h].ctypes.data, keys.itemsize, np.ascontiguousarray(k[:, h]),
                   np.ascontiguousarray(v[:, h]), start, dim)
    end = start + count
    padded = (end + KEYS - 1) // KEYS * KEYS
    _layout(keys, values, laid_from // 16 * 16, end, padded, laid_k, laid_v)
    rows = count * group
    pairs = np.zeros((kv_heads, (rows + ROWS - 1) // ROWS * ROWS, dim // 2), dtype=np.uint32)
    for i in prange(count):
        for head in range(heads):
            for d in range(dim // 2):
                pairs[head // group, i * group + head % group, d] = _pair(q[i, head, 2 * d], q[i, head, 2 * d + 1])
    scores = np.empty((threads, ROWS * padded), dtype=np.float32)
    weights = np.empty((threads, ROWS * padded), dtype=np.uint16)
    sums = np.empty((threads, ROWS, dim), dtype=np.float32)
    inverses = np.empty((threads, ROWS), dtype=np.float32)
    _attend(pairs, laid_k, laid_v, start, group, count, out, scores, weights, sums, inverses, tiles)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           start: int, laid: Laid | None = None, layer: int = 0, out: np.ndarray | None = None,
           write: bool = True) -> torch.Tensor:
    """As attention.attend_in_place: writes the chunk's k and v [count, kv_heads, dim] into the cache (keys, values
    [kv_heads, capacity, dim], float16 or float32) at start.. (unless not `write`; k, v float32), then returns the
    causal grouped-query attention of q [count, heads, dim] (float32, already scaled) against it, [count, heads *
    dim] float32, in `out` [count, heads, dim] when given. `laid`: the cache's kept layouts (layer `layer`'s are
    used and brought up to date), else made for this call."""
    count, heads, dim = q.shape
    end = start + count
    if laid is None or laid.capacity < end:
        laid, layer = Laid(1, keys.shape[0], end, dim), 0
    out = np.empty((count, heads, dim), dtype=np.float32) if out is None else out
    _chunk(q.numpy(), k.numpy(), v.numpy(), _elements(keys), _elements(values), start, write, laid.k[layer],
           laid.v[layer], min(laid.laid[layer], start), out, kernels(dim), numba.get_num_threads())
    laid.laid[layer] = end
    return torch.from_numpy(out).view(count, heads * dim)


def kept(cache, dim: int) -> Laid:
    """`cache`'s (forward.StaticCache) kept layouts, made when it has none or has outgrown them."""
    if cache.laid is None or cache.laid.capacity < cache.capacity:
        layers, kv_heads = cache.shape[:2]
        cache.laid = Laid(layers, kv_heads, cache.capacity, dim)
    return cache.laid
