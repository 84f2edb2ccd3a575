"""Attention against the KV cache for sequences with few new rows (decoding, verifying short drafts), on CPUs.

At editor-sized contexts the cache, not the weights, is what each extra session adds to a batched forward: 8
sessions of 1,450 tokens hold 534 MB of float32 keys and values, about as much as the model's weights, and every
forward reads all of it. PyTorch's CPU kernels read it at 5-9 GB/s for one to four query rows per sequence
(a GEMM with 3-12 rows packs its operands; `scaled_dot_product_attention` with a mask falls back to the same),
against 29 GB/s that these 2 cores can stream. Here one kernel per layer runs every such sequence's attention,
each (sequence, KV head) pair on its own thread: it streams that head's keys once for all the query heads of its
group and all the sequence's rows (attention_tiles' tiles: 16 keys at a time, their sums added down together), takes
each row's softmax (an IR tile: ir.softmax_ir), then streams the values once for up to four rows at a time.
Measured, 30 layers, 8 sequences x 1,450 cached tokens: 1 row each 51 -> 25 ms, 2 rows 86 -> 34 ms, 4 rows
100 -> 59 ms (numba's own dot products, before the tiles); one sequence at 2,600 cached tokens, 1 / 2 / 3 / 4
rows: 8.1 / 11.2 / 10.9 / 12.5 ms with numba's, 6.1 / 7.7 / 9.4 / 11.4 with the tiles, and 18.4 / 30.9 ms at 8 /
16 rows against PyTorch's 24.2 / 34.6.

It is numba (LLVM, shipped as wheels: no compiler needed), registered as the torch operator
`codespec::cached_attention` so that the TorchScript layer loop calls it without returning to Python. Each query
row's result is computed alone, in float32, by the same instructions whatever else the forward holds: its scores
key by key, its softmax over the keys up to its own position, its weighted sum in position order. So a request
gets the same bits alone or in any batch, and a verify forward the same as one-token forwards; it matches
PyTorch's attention to float rounding (differences ≤ 1e-5). Caches of float16 (--cache-type f16, the default on
CPUs) get their new keys and values rounded as they are written and are widened as they are read. q8 caches
(--cache-type q8) hold each key and value as 8-bit integers and a float32 scale; the query rows are rounded alike
and scored in exact integer sums (attention_tiles.scores_q8_ir).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading

from typing import Optional

import numba
from numba.core import event as numba_events
import numpy as np
import torch
import torch.nn.functional as F
from numba import prange
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from . import attention_tiles, capabilities
from .native import call

FEW_ROWS = 16  # sequences with at most this many rows in a forward come here (measured, 30 layers at 1,000 and
# 2,600 cached tokens: up to 16 rows the kernel beats PyTorch's attention; at 32 and 64 rows it does not)
COLUMNS = 15  # the table: key address, value address, capacity, first row, start, count, first score row, bytes
# per cache element (4: float32, 2: float16, --cache-type f16, 1: q8, whose rows hold dim integers and a scale),
# then a shared prefix (StaticCache.shared_prefix): another cache's key address, value address and capacity, and the
# count of positions read from it (a multiple of 16; 0: none); then the unit it attends in (make_table): the table
# index of the unit's first sequence, the unit's query positions (its sequences' counts added) and this sequence's
# offset among them. A unit is one sequence, or the sequences that read one shared prefix (alternatives of a
# prompt, the source among them), whose rows score and weigh that prefix together: its keys widened and its values
# read once for all their rows, not once a sequence.


@intrinsic
def _pointer(typingctx, address):
    """An integer address as a pointer (for numba.carray)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.int64), codegen


def _bitcast(source, target):
    """An intrinsic that reads a `source` value's bits as a `target` (numba types of one size)."""
    @intrinsic
    def bitcast(typingctx, value):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(target))
        return target(source), codegen
    return bitcast


_float_bits = _bitcast(types.uint32, types.float32)  # the float32 whose bits are a uint32
_bits = _bitcast(types.float32, types.int32)  # a float32's bits, as an int32


@numba.njit(inline="always", cache=True)
def _row_bytes(itemsize, dim):
    """Bytes of one cached key or value of a head (q8: dim int8 and a float32 scale)."""
    return dim * itemsize if itemsize > 1 else dim + 4


@numba.njit(inline="always", cache=True)
def _task(table, task, layer, kv_heads, group, dim):
    """A (sequence s, KV head h)'s first row in qk/out, start position, row count, query rows (count x group),
    first score row, and the byte offset of this layer and head in its caches. A unit's score rows for head h are
    its sequences' rows in turn: [unit first row + h x unit rows, + unit rows)."""
    s, h = task // kv_heads, task % kv_heads
    capacity, first, start, count = table[s, 2], table[s, 3], table[s, 4], table[s, 5]
    rows = count * group
    row_bytes = _row_bytes(table[s, 7], dim)
    return (s, h, first, start, count, rows, table[s, 6] + (h * table[s, 13] + table[s, 14]) * group,
            (layer * kv_heads + h) * capacity * row_bytes)


@numba.njit(cache=True)
def _units(table):
    """The table index of each unit's first sequence (make_table: a unit's sequences are adjacent)."""
    return np.array([s for s in range(table.shape[0]) if table[s, 12] == s], dtype=np.int64)


@numba.njit(inline="always", cache=True)
def _within(table, unit, s, group, high):
    """Whether table entry s is a sequence of the unit whose query rows start before the unit's row `high`."""
    return s < table.shape[0] and table[s, 12] == unit and table[s, 14] * group < high


@numba.njit(inline="always", cache=True)
def _member(table, unit, i, group):
    """The sequence of a unit (its first at table index `unit`) whose query rows hold the unit's row i."""
    s = unit
    while _within(table, unit, s + 1, group, i + 1):
        s += 1
    return s


@intrinsic
def _to_half(typingctx, value):
    """The bits of a float32 rounded to float16 (to nearest, ties to even, as PyTorch's .half())."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@numba.njit(inline="always", cache=True, boundscheck=False)
def _store_bits(row, at, bits):
    """An int32's bytes, little-endian, into row[at : at + 4] (int8)."""
    for b in range(4):
        row[at + b] = np.int8(np.int32(((bits >> (8 * b)) & 255) ^ 128) - 128)


@numba.njit(inline="always", cache=True, boundscheck=False)
def _quantize(x, row, key):
    """x (float32 [dim]) into a q8 row (int8 [dim + 4] or more): x rounded to integers (x * 127 / its largest
    magnitude, half to even) times one scale (that magnitude * float32(1 / 127)), then the scale's float32 bytes.
    A key's integers are stored plus 128 (as unsigned bytes, which vpdpbusd takes: attention_tiles.scores_q8_ir).
    Returns the sum of the integers."""
    dim = x.shape[0]
    top = np.float32(0.0)
    for d in range(dim):
        top = max(top, abs(x[d]))
    factor = np.float32(127.0) / top if top > 0 else np.float32(0.0)
    offset = np.int32(-128) if key else np.int32(0)  # xor with the sign bit: plus 128, as an unsigned byte
    total = 0
    for d in range(dim):
        integer = np.int32(np.rint(x[d] * factor))
        total += integer
        row[d] = np.int8(integer ^ offset)
    # a product, not top / 127: inlined by LLVM into a fast-math caller (the attention loop), a division by a constant
    # became a product by its reciprocal, and the kernel's scales differed in the last bit from a prompt chunk's
    _store_bits(row, dim, _bits(top * np.float32(1.0 / 127.0)))
    return total


@numba.njit(fastmath=False, cache=True, boundscheck=False)
def _write(keys_at, values_at, itemsize, new_keys, new_values, start, dim):
    """New keys and values [count, dim] into a cache head's rows start.. (addresses keys_at, values_at), rounded to
    float16 when its elements are 2 bytes (numba has no float16: as their bits), to q8 rows when 1 byte. A call of
    its own: inlined into the parallel loop, numba's dead-code pass drops these stores (the arrays are not read
    there after)."""
    count = new_keys.shape[0]
    if itemsize == 1:
        keys = numba.carray(_pointer(keys_at), (start + count, dim + 4), np.int8)
        values = numba.carray(_pointer(values_at), (start + count, dim + 4), np.int8)
        for i in range(count):
            _quantize(new_keys[i], keys[start + i], True)
            _quantize(new_values[i], values[start + i], False)
    elif itemsize == 4:
        keys = numba.carray(_pointer(keys_at), (start + count, dim), np.float32)
        values = numba.carray(_pointer(values_at), (start + count, dim), np.float32)
        keys[start:] = new_keys
        values[start:] = new_values
    else:
        halves = numba.carray(_pointer(keys_at), (start + count, dim), np.uint16)
        value_halves = numba.carray(_pointer(values_at), (start + count, dim), np.uint16)
        for i in range(count):
            for d in range(dim):
                halves[start + i, d] = _to_half(new_keys[i, d])
                value_halves[start + i, d] = _to_half(new_values[i, d])


SPLIT_ROWS = 12  # a (sequence, KV head) with at least this many query rows may be split between threads (below, a
# split reads its keys once per part for little work: decoding's 3 rows a head stay whole)


@numba.njit(inline="always", cache=True)
def _own(table, s, column, layer, kv_heads, h, row_bytes):
    """The address of sequence s's own keys (column 0) or values (1) at `layer`, head h, past its shared prefix."""
    return table[s, column] + ((layer * kv_heads + h) * table[s, 2] + table[s, 11]) * row_bytes


@numba.njit(fastmath=False, cache=True)
def schedule(table, kv_heads, group, threads):
    """`_attend`'s tasks in order, each a part of a (unit, KV head) pair's query rows: [tasks, 3] = (pair, part,
    parts), pair = unit index x kv_heads + head (units: `_units`). numba's parallel loop hands each thread an equal
    run of consecutive tasks, so the pairs are shared out evenly: where they do not divide between the threads,
    every pair is split into `threads` parts if the longest has SPLIT_ROWS rows or more (one sequence of the default
    model: 3 KV heads on 2 threads, one thread did two heads' work while the other waited: 16 rows at 660 cached
    keys, 6.6 -> 5.0 ms a forward); with fewer rows (decoding) only the pairs left over are, each thread's run ending
    with one part of each (decoding one sequence at 1,500 cached keys: the threads' shares 2 : 1 pairs -> 1.5 : 1.5,
    each part reading the pair's keys)."""
    units = _units(table)
    most = 0
    for unit in units:
        most = max(most, table[unit, 13] * group)
    pairs = units.shape[0] * kv_heads
    over = pairs % threads
    if over and most >= SPLIT_ROWS:
        tasks = np.empty((pairs * threads, 3), dtype=np.int64)
        for task in range(pairs * threads):
            tasks[task, 0], tasks[task, 1], tasks[task, 2] = task // threads, task % threads, threads
        return tasks
    each = pairs // threads  # whole pairs a thread takes
    tasks = np.empty((pairs + over * (threads - 1), 3), dtype=np.int64)
    task = 0
    for thread in range(threads):
        for pair in range(thread * each, (thread + 1) * each):
            tasks[task, 0], tasks[task, 1], tasks[task, 2] = pair, 0, 1
            task += 1
        for left in range(over):  # (none where the pairs divide evenly)
            tasks[task, 0], tasks[task, 1], tasks[task, 2] = threads * each + left, thread, threads
            task += 1
    return tasks


@numba.njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def _attend(qk, v, table, layer, heads, kv_heads, scores, weights, out, kernels, threads):
    """Attention of every (unit, KV head) in `table` at `layer`: writes the sequences' new keys (from qk [rows,
    heads + kv_heads, dim]) and values (v [rows, kv_heads, dim]) into their caches, then, a part of a pair's query
    rows a task (`schedule`, for `threads` threads), scores each row against the keys (attention_tiles' tile, 16 keys
    at a time: keys are read up to the next multiple of 16, which a cache's capacity holds), takes each row's softmax
    over the keys up to its position (attention_tiles' softmax, whose sums' order no inlining can change), and adds
    the rows' weighted values into out [rows, heads, dim]. Each row goes through the same instructions whichever
    part, unit or tile call it falls in.
    A sequence with a shared prefix (table[s, 11] positions, a multiple of 16) reads those keys and values from the
    other cache (the same bits: StaticCache.shared_prefix), the rest from its own: its scores are key by key, and its
    values tile goes on from the prefix's sums (attention_tiles.values_ir), so each row gets the bits it gets from
    its own cache alone. The sequences of a unit share that prefix: one tile call scores all their rows of a part
    against it, and values tiles take up to GROUP of their rows at a time over it, whichever sequence each is of;
    then each sequence's own keys and values follow for its rows."""
    dim = qk.shape[2]
    group = heads // kv_heads
    width = scores.shape[1]
    for task in range(table.shape[0] * kv_heads):  # the new keys and values first: every part reads them
        s, h, first, start, count, rows, base, offset = _task(table, task, layer, kv_heads, group, dim)
        _write(table[s, 0] + offset, table[s, 1] + offset, table[s, 7], qk[first : first + count, heads + h],
               v[first : first + count, h], start, dim)
    units = _units(table)
    tasks = schedule(table, kv_heads, group, threads)
    for task in prange(tasks.shape[0]):
        pair, part, split = tasks[task, 0], tasks[task, 1], tasks[task, 2]
        unit, h = units[pair // kv_heads], pair % kv_heads
        total = table[unit, 13] * group  # the unit's query rows
        low, high = total * part // split, total * (part + 1) // split  # this part's
        if low == high:
            continue
        base = table[unit, 6] + h * total
        itemsize = table[unit, 7]
        row_bytes = _row_bytes(itemsize, dim)
        shared = table[unit, 11]  # keys 0..shared from the prefix's cache, the rest from each sequence's own
        shared_offset = (layer * kv_heads + h) * table[unit, 10] * row_bytes
        shared_keys, shared_values = table[unit, 8] + shared_offset, table[unit, 9] + shared_offset
        tiles = kernels[0 if itemsize == 4 else (1 if itemsize == 2 else 2)]
        q = np.empty((high - low, dim), dtype=np.float32)
        for i in range(low, high):
            s = _member(table, unit, i, group)
            r = i - table[s, 14] * group
            q[i - low] = qk[table[s, 3] + r // group, h * group + r % group]
        rows_at, row_size = q.ctypes.data, 4 * dim
        if itemsize == 1:  # q8: the query rows rounded to 8 bits too, each with its scale and 128 x its sum
            packed = np.empty((high - low, dim + 8), dtype=np.int8)
            for r in range(high - low):
                _store_bits(packed[r], dim + 4, 128 * _quantize(q[r], packed[r], False))
            rows_at, row_size = packed.ctypes.data, dim + 8
        if shared:
            call(tiles[0], rows_at, high - low, shared_keys, shared, scores[base + low :].ctypes.data, width)
        s = _member(table, unit, low, group)
        while _within(table, unit, s, group, high):  # each sequence's own keys
            a, b = max(low, table[s, 14] * group), min(high, (table[s, 14] + table[s, 5]) * group)
            padded = (table[s, 4] + table[s, 5] + 15) // 16 * 16
            call(tiles[0], rows_at + (a - low) * row_size, b - a, _own(table, s, 0, layer, kv_heads, h, row_bytes),
                 padded - shared, scores[base + a :].ctypes.data + 4 * shared, width)
            for i in range(a, b):  # a row of s's query j at position start + j sees keys 0..start + j
                call(tiles[1], scores[base + i :].ctypes.data, table[s, 4] + (i - table[s, 14] * group) // group + 1,
                     weights[base + i :].ctypes.data, padded, 0, 0)
            s += 1
        most = len(tiles) - 2  # rows a values tile adds into at once (attention_tiles.value_rows)
        sums = np.empty((most, dim), dtype=np.float32)
        r = low
        while r < high:  # up to `most` rows share each value row read
            take = min(most, high - r)
            if shared:
                call(tiles[1 + take], weights[base + r :].ctypes.data, width, shared_values, shared, sums.ctypes.data,
                     0)
            s = _member(table, unit, r, group)
            while _within(table, unit, s, group, r + take):  # each sequence's own values
                a, b = max(r, table[s, 14] * group), min(r + take, (table[s, 14] + table[s, 5]) * group)
                call(tiles[1 + b - a], weights[base + a :].ctypes.data + 4 * shared, width,
                     _own(table, s, 1, layer, kv_heads, h, row_bytes), table[s, 4] + table[s, 5] - shared,
                     sums.ctypes.data + (a - r) * 4 * dim, shared)
                for i in range(a, b):
                    local = i - table[s, 14] * group
                    out[table[s, 3] + local // group, h * group + local % group, :] = sums[i - r]
                s += 1
            r += take


def padded_width(keys: int) -> int:
    """The score rows' width for sequences of up to `keys` keys: the tiles write whole blocks of 16."""
    return (keys + 15) // 16 * 16


def attend_in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    start: int, mask: Optional[torch.Tensor], wide: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch's attention for one sequence with many rows (a prompt chunk, a long draft): writes k and v
    [count, kv_heads, dim] into the cache (keys, values [kv_heads, capacity, dim]) at start.., then returns the
    grouped-query attention of q [count, heads, dim] against the cache in place, [count, heads * dim].
    enable_gqa lets each group of query heads share its KV head without repeating the cache. A sequence's first
    rows (start 0) need no mask: is_causal skips the blocks above the diagonal, where a mask only hides them
    (measured, one layer, 700 rows: 10.0 -> 7.4 ms, the same numbers). A float16 cache (--cache-type f16) is read
    widened to float32 (what the kernel's tiles read), into `wide` when given (a buffer kept between calls: a fresh
    one per layer is a fresh mmap, whose page faults made a 3,500-token prompt ~10% slower)."""
    count = q.shape[0]
    end = start + count
    keys[:, start:end] = k.transpose(0, 1)
    values[:, start:end] = v.transpose(0, 1)
    causal = start == 0 and count > 1  # (a mask is built only for rows that start later)
    keys, values = keys[:, :end], values[:, :end]
    if keys.dtype != q.dtype:
        if wide is None:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        else:
            size = keys.numel()
            keys = wide[:size].view(keys.shape).copy_(keys)
            values = wide[size : 2 * size].view(values.shape).copy_(values)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=mask, is_causal=causal, scale=1.0, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(count, -1)


@intrinsic
def _from_half(typingctx, bits):
    """The float32 value of a float16's bits."""
    from llvmlite import ir

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


def _widened(element):
    """An element of a cache as float64 (numba has no float16: a float16 cache is read as its bits)."""


@overload(_widened, jit_options={"cache": True, "fastmath": False})
def _widened_by_type(element):
    if element == types.uint16:
        return lambda element: np.float64(_from_half(element))
    return lambda element: np.float64(element)


def _narrowed(value, element):
    """value (float64) rounded as a cache holding `element`s stores it: once to float32, and once more to float16
    for a float16 cache, as PyTorch assigns it; float64 caches keep it."""


@overload(_narrowed, jit_options={"cache": True, "fastmath": False})
def _narrowed_by_type(value, element):
    if element == types.uint16:
        return lambda value, element: _to_half(np.float32(value))
    if element == types.float32:
        return lambda value, element: np.float32(value)
    return lambda value, element: value


@numba.njit(fastmath=False, parallel=True, cache=True, boundscheck=False)
def _move(keys, values, into_keys, into_values, source, target, count, turn):
    """Positions source.. of every layer and KV head to target.. of the `into` caches (the same ones, with target <
    source, or others): values as they are, keys (pairs rotated by their position) turned by turn [dim / 2,
    (cos, sin)] in float64 and rounded as the cache stores them (float16 caches come as their bits)."""
    layers, kv_heads = keys.shape[0], keys.shape[1]
    half = turn.shape[0]
    for task in prange(layers * kv_heads):
        layer, head = task // kv_heads, task % kv_heads
        for i in range(count):  # rising: within one cache a position is read before any write reaches it
            old, new = keys[layer, head, source + i], into_keys[layer, head, target + i]
            for pair in range(half):
                x, y = _widened(old[2 * pair]), _widened(old[2 * pair + 1])
                c, s = turn[pair, 0], turn[pair, 1]
                new[2 * pair] = _narrowed(x * c - y * s, old[0])
                new[2 * pair + 1] = _narrowed(x * s + y * c, old[0])
            into_values[layer, head, target + i] = values[layer, head, source + i]


@numba.njit(inline="always", cache=True, boundscheck=False)
def _scale_of(row, dim):
    """The float32 scale of a q8 cache row (its 4 bytes after the dim integers)."""
    bits = np.uint32(0)
    for b in range(4):
        bits |= np.uint32(np.uint8(row[dim + b])) << np.uint32(8 * b)
    return _float_bits(bits)


@numba.njit(fastmath=False, parallel=True, cache=True, boundscheck=False)
def _move_q8(keys, values, into_keys, into_values, source, target, count, turn):
    """_move for q8 caches (int8 [layers, kv_heads, capacity, dim + 4]): each key read as its integers times its
    scale, turned in float64, rounded to float32 and quantised again; values (with their scales) as they are."""
    layers, kv_heads, dim = keys.shape[0], keys.shape[1], keys.shape[3] - 4
    half = turn.shape[0]
    for task in prange(layers * kv_heads):
        layer, head = task // kv_heads, task % kv_heads
        turned = np.empty(dim, dtype=np.float32)
        for i in range(count):  # rising: within one cache a position is read before any write reaches it
            old = keys[layer, head, source + i]
            scale = np.float64(_scale_of(old, dim))
            for pair in range(half):  # the integers are stored plus 128
                x = (np.int32(old[2 * pair]) ^ np.int32(-128)) * scale
                y = (np.int32(old[2 * pair + 1]) ^ np.int32(-128)) * scale
                c, s = turn[pair, 0], turn[pair, 1]
                turned[2 * pair] = np.float32(x * c - y * s)
                turned[2 * pair + 1] = np.float32(x * s + y * c)
            _quantize(turned, into_keys[layer, head, target + i], True)
            into_values[layer, head, target + i] = values[layer, head, source + i]


@numba.njit(fastmath=False, cache=True, boundscheck=False)
def write_q8(keys, values, new_keys, new_values, start):
    """New keys and values [count, kv_heads, dim] (float32) into a q8 cache layer's rows start.. (int8 [kv_heads,
    capacity, dim + 4]), rounded as the kernel rounds them."""
    for h in range(keys.shape[0]):
        for i in range(new_keys.shape[0]):
            _quantize(new_keys[i, h], keys[h, start + i], True)
            _quantize(new_values[i, h], values[h, start + i], False)


def dequantized(rows: torch.Tensor, keys: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A q8 cache's rows (int8 [..., dim + 4]; keys' integers stored plus 128) as float32 [..., dim]: each row's
    integers times its scale (into `out` when given)."""
    dim = rows.shape[-1] - 4
    scales = rows[..., dim:].contiguous().view(torch.float32)  # [..., 1]
    integers = rows[..., :dim] ^ -128 if keys else rows[..., :dim]
    if out is None:
        return integers.float().mul_(scales)
    return torch.mul(out.copy_(integers), scales, out=out)


def move_cached(keys: torch.Tensor, values: torch.Tensor, source: int, target: int, count: int,
                turn: torch.Tensor, into: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """forward.LeanLlama.move for CPU caches ([layers, kv_heads, capacity, dim] of float32, float64 or float16): one
    pass, in place (or into another cache's keys and values: `into`), no temporaries but the moved rows when they
    move up within one cache (a layer at a time in PyTorch cost 25-160 ms for 2,500 positions, most of it allocation
    and per-operation overhead; this takes a few). q8 caches (int8 rows of dim integers and a scale) too."""
    match_threads()
    into_keys, into_values = into if into is not None else (keys, values)
    if into_keys.data_ptr() == keys.data_ptr() and target > source:  # moving up within one cache: a copy first,
        # else a write would reach rows not read yet
        keys, values = (t[:, :, source : source + count].clone() for t in (keys, values))
        source = 0
    turn = torch.view_as_real(turn).contiguous().numpy()
    if keys.dtype == torch.int8:  # q8
        _move_q8(keys.numpy(), values.numpy(), into_keys.numpy(), into_values.numpy(), source, target, count, turn)
        return
    _move(*(elements(t) for t in (keys, values, into_keys, into_values)), source, target, count, turn)


def elements(cache: torch.Tensor) -> np.ndarray:
    """A CPU cache tensor as numba reads and writes it: float16 as its bits (numba has no float16), else as is."""
    return cache.view(torch.uint16).numpy() if cache.dtype == torch.float16 else cache.numpy()


def cached_attention(qk: torch.Tensor, v: torch.Tensor, out: torch.Tensor, table: torch.Tensor, layer: int,
                     heads: int, kv_heads: int, rows: int, width: int) -> None:
    """Attention of the sequences in `table` (one row each: key and value cache addresses, capacity, first row
    in qk/v/out, start position, row count, first score row) at `layer`: writes their keys (qk [rows, heads +
    kv_heads, dim], rotated) and values (v [rows, kv_heads, dim]) into the caches ([layers, kv_heads, capacity,
    dim] float32 each) and their attention into out [rows, heads, dim].
    `rows` score rows (heads x the sequences' rows) of `width` keys (padded_width of the longest sequence's) are
    written between. Caches of float16 (--cache-type f16) have their new keys and values rounded, q8 ones quantised."""
    match_threads()
    scores, weights = _scratch(rows * width)
    scores, weights = scores[: rows * width].view(rows, width), weights[: rows * width].view(rows, width)
    # contiguous, as layers.py passes them: one compiled signature, which ready() compiles before any request
    _attend(qk.contiguous().numpy(), v.contiguous().numpy(), table.numpy(), layer, heads, kv_heads, scores.numpy(),
            weights.numpy(), out.numpy(), attention_tiles.kernels(qk.shape[2]), numba.get_num_threads())


def match_threads() -> None:
    """numba's pool uses as many threads as PyTorch's."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


_SCRATCH = threading.local()


def _scratch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 buffers of at least `size`, kept per thread: a fresh megabyte-sized tensor per layer would be a
    fresh mmap (memory.py lowers glibc's threshold) and its page faults cost as much as the softmax itself."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None or buffers[0].numel() < size:
        size = max(size, 2 * buffers[0].numel() if buffers is not None else size)
        buffers = _SCRATCH.buffers = (torch.empty(size, dtype=torch.float32), torch.empty(size, dtype=torch.float32))
    return buffers


_LIBRARY = torch.library.Library("codespec", "DEF")
_LIBRARY.define("cached_attention(Tensor qk, Tensor v, Tensor(a!) out, Tensor table, int layer, int heads, "
                "int kv_heads, int rows, int width) -> ()")
_LIBRARY.impl("cached_attention", cached_attention, "CPU")


def make_table(rows, first_rows: list[int], heads: int) -> torch.Tensor:
    """The kernel's table for `rows` (forward.Rows, float32 caches on the CPU) starting at first_rows in the batch.
    Sequences that read one shared prefix (alternatives forked from one source: StaticCache.shared_prefix) form a
    unit, with the source itself where it is in the batch (it reads the same positions from its own cache): their
    entries adjacent, their score rows by head (`_task`)."""
    entries, units = [], {}  # units: (prefix key address, positions) or (None, index) -> table entries
    for index, (r, first) in enumerate(zip(rows, first_rows)):
        cache = r.cache
        if cache.keys.dtype == torch.int8 and attention_tiles.q8_instruction_set() is None:  # (its scores tile is
            capabilities.check("q8 cache attention")  # compiled only where it runs: this names what is missing)
        if cache.length + len(r.ids) > cache.capacity:  # the kernel writes the rows' keys there: past the end corrupts
            raise ValueError(f"{len(r.ids)} rows at position {cache.length} overflow a cache of {cache.capacity}")
        other, count = cache.shared_prefix() or (cache, 0)
        entries.append([cache.keys.data_ptr(), cache.values.data_ptr(), cache.capacity, first, cache.length,
                        len(r.ids), 0, cache.keys.element_size(), other.keys.data_ptr(), other.values.data_ptr(),
                        other.capacity, count])
        units.setdefault((other.keys.data_ptr(), count) if count else (None, index), []).append(index)
    for (address, count), members in list(units.items()):  # a source in the batch joins its followers' unit
        source = next((i for i, entry in enumerate(entries) if entry[0] == address and entry[11] == 0), None)
        if address is not None and source is not None and entries[source][4] >= count:
            entries[source][8:12] = [*entries[source][0:3], count]  # (its prefix read from its own cache)
            members.insert(0, units.pop((None, source))[0])
    table, score_row = [], 0
    for members in units.values():
        unit, total = len(table), sum(entries[i][5] for i in members)
        for offset, i in zip(itertools.accumulate((entries[i][5] for i in members), initial=0), members):
            table.append(entries[i][:6] + [score_row] + entries[i][7:] + [unit, total, offset])
        score_row += heads * total
    return torch.tensor(table, dtype=torch.int64).reshape(-1, COLUMNS)


@functools.cache
def ready() -> bool:
    """Compile (or load from numba's on-disk cache) both kernels and run them once on a tiny input, so no request
    waits for it; True where the capability table lets them run (numba's OpenMP pool; without it, PyTorch's
    attention)."""
    if not capabilities.available("cache attention"):
        return False
    keys = torch.randn(1, 1, 16, 16)
    values = torch.randn(1, 1, 16, 16)
    qkv = torch.randn(2, 3, 16)
    out = torch.empty(2, 1, 16)
    entry = torch.tensor([[keys.data_ptr(), values.data_ptr(), 16, 0, 3, 2, 0, 4, 0, 0, 0, 0, 0, 2, 0]],
                         dtype=torch.int64)
    with compiling_notice():
        cached_attention(qkv[:, :2], qkv[:, 2:], out, entry, 0, 1, 1, 2, 16)
        move_cached(keys, values, 4, 1, 3, torch.ones(2, dtype=torch.complex128))
        move_cached(keys, values, 1, 4, 3, torch.ones(2, dtype=torch.complex128), (keys.clone(), values.clone()))
        move_cached(keys.half(), values.half(), 4, 1, 3, torch.ones(2, dtype=torch.complex128))
        small = torch.zeros(1, 1, 16, 20, dtype=torch.int8)  # q8: the writes and moves (the kernel's are the same)
        write_q8(small[0].numpy(), small[0].clone().numpy(), qkv[:, 2:].numpy(), qkv[:, 2:].numpy(), 0)
        move_cached(small, small.clone(), 4, 1, 3, torch.ones(2, dtype=torch.complex128))
    return True


_NOTICED = threading.Event()


@contextlib.contextmanager
def compiling_notice():
    """One line on stderr, once per process, when loading the kernels compiles one: the first use on a machine
    compiles them (about 30 s on 2 cores for attention.py, layers.py and block_tiles.py together; then they load from
    numba's on-disk cache in well under a second). Said at numba's own "numba:compile" event, which only a cache
    miss raises: a timer said it whenever loading took over a second, which on a busy host was every start."""
    class Notice(numba_events.Listener):
        def on_start(self, event):
            if not _NOTICED.is_set():
                _NOTICED.set()
                print("codespec: compiling the CPU kernels (numba, once per machine, about 30 s)", file=sys.stderr,
                      flush=True)

        def on_end(self, event):
            pass

    with numba_events.install_listener("numba:compile", Notice()):
        yield
