"""Give freed buffers back to the system, so a long-running server's memory levels off at what it holds.

glibc serves an allocation of at least M_MMAP_THRESHOLD bytes with its own mmap, unmapped again on free. By default
the threshold is dynamic: each large buffer freed raises it (up to 32 MB on 64-bit), so the next ones come from the
heap instead, and a heap keeps what is freed inside it. A server that builds and drops per-request tensors of a few
MB (logits over the vocabulary, attention scratch) ends with hundreds of MB that are free but never returned
(measured: RSS 250-400 MB above the KV caches). A fixed threshold keeps those buffers on mmap.

Fixing it also fixes glibc's trim threshold, at its start of 128 KiB (the dynamic rule keeps it at twice the mmap
threshold): every free that leaves more than 128 KiB at the top of a heap hands those pages back, and the next
allocation faults them in again. A prompt chunk's buffers of 128 KiB to 1 MB did that ~2,400 times in one 3,539-token
prefill (madvise on the thread's arena; measured in a process on a thread: 2.2-2.9 s against 1.9 s with the dynamic
rule). So the trim threshold is set to twice the mmap threshold, as that rule would: a heap keeps at most 2 MB of
free pages at its top.

oneDNN keeps a compiled primitive for every matmul shape it meets, up to 1,024 of them, and a batched forward meets
a new shape with every new number of rows: measured on the default model's four layer shapes, 159 row counts swept
three times, RSS went 244 -> 644 -> 791 -> 815 MB and had not levelled off. A primitive costs microseconds to
create against milliseconds for the matmul it runs (the sweep ran no slower with 8 cached), so a small cache bounds
that memory for nothing: with 32 it stays flat after the first sweep.

Above oneDNN, PyTorch's ideep layer keeps its own per-thread cache of matmul computations keyed by the input shapes,
also up to 1,024 ($LRU_CACHE_CAPACITY). Measured on the default model's lean forward, batches of 1-8 sessions with
1-128 rows each: the heap in use went 264 -> 347 -> 388 -> 411 -> 430 MB over 900 forwards and was still rising
(what the 16-editor soak showed: +25 MB a minute); with 16 kept it stayed at 172-175 MB, and a forward over random
row counts cost the same (101 vs 103 ms median, within noise).

Python's cyclic collector walks every object at each full pass: ~440k once torch, transformers and numba are imported
and a model is loaded. `lifelong_heap` builds those with the collector off and freezes them out of later passes.
"""


from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os

M_MMAP_THRESHOLD = -3  # mallopt's parameter numbers, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
MMAP_THRESHOLD = 1 << 20  # bytes: larger allocations are mmapped and returned on free (glibc's own start: 128 KiB)
ENVIRONMENT = "CODESPEC_MMAP_THRESHOLD"  # bytes, overriding MMAP_THRESHOLD; 0 leaves glibc's dynamic threshold
PRIMITIVE_CACHE = 32  # oneDNN primitives kept (its default: 1,024); $ONEDNN_PRIMITIVE_CACHE_CAPACITY overrides
LRU_CACHE = 16  # ideep computations kept per thread (its default: 1,024); $LRU_CACHE_CAPACITY overrides


def return_freed_memory() -> int:
    """Fix glibc's mmap threshold (and its trim threshold at twice that) and bound oneDNN's and ideep's caches, once
    at process start, before the first forward (both read their variables when they first create what they cache).
    Returns the threshold set; 0 when nothing was changed: not glibc (macOS, musl), $MALLOC_MMAP_THRESHOLD_ already
    set by the user (glibc read it at start), or $CODESPEC_MMAP_THRESHOLD=0."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(LRU_CACHE))
    threshold = int(os.environ.get(ENVIRONMENT) or MMAP_THRESHOLD)
    if threshold <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return 0
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        return 0
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:  # (the user's, read by glibc at start, stays)
        mallopt(M_TRIM_THRESHOLD, 2 * threshold)
    return threshold


OWN_PROCESS = False  # the `codespec` command's process (cli.console sets it), not a caller's


@contextlib.contextmanager
def lifelong_heap():
    """In the `codespec` command's own process, imports and the one engine of `generate`, `serve` or `lsp` live as
    long as it does: Python's cyclic collector stays off while they are built (each full pass walks all ~440k objects
    of torch, transformers and numba to find ~8k cycles and no memory: 0.3-0.5 s of a 3.4 s `codespec generate`),
    then freezes them out of every later pass (a served request's collections walk only what requests made)."""
    if not OWN_PROCESS:  # a caller's process (tests, scripts) keeps its collector as it was
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
