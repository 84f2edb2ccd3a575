"""What each kernel needs from the CPU, in one table: the plan, every kernel's `ready()`/`available()` and the tests
ask here, and a kernel whose needs are missing is never compiled (LLVM aborts the whole process on an intrinsic its
target lacks; numba's parallel loops without an OpenMP or TBB pool wake their threads too slowly to pay).

Features are LLVM's names ("avx512vnni", ...), and "openmp" for a numba thread pool that pays (OpenMP, or TBB).
"""

from __future__ import annotations

import functools
import os

import numba

NEEDS = {
    "layers": ("openmp",),  # layers.py: a layer's projections, norms and MLP for few rows, in numba's parallel loops
    "cache attention": ("openmp",),  # attention.py: rows against the KV cache (float32 and float16 caches)
    "q8 cache attention": ("openmp", "avx2"),  # attention_tiles.py's q8 scores: vpmaddwd
    "q8 cache attention, vnni": ("openmp", "avx512vnni"),  # the same scores in vpdpbusd, where the CPU has it
    "q8 cache attention, sdot": ("openmp", "dotprod"),  # and in ARM64's sdot (the dot-product extension)
    "silu": (),  # layers.py's SiLU times up: plain IR, any target
    "float block tiles": (),  # block_tiles.py: a GGUF's blocks times float32 rows, plain 16-lane IR
    "four-row block tiles": ("avx512f",),  # their 3- and 4-row tiles: four rows' sums fit only 32 vector registers
    "q8 block tiles": ("avx2",),  # q8_tiles.py: a GGUF's blocks times rows rounded to 8 bits, vpmaddubsw
    "q8 block tiles, vnni": ("avx512vnni",),  # the same tiles in vpdpbusd, where the CPU has it
    "q8 block tiles, neon": ("dotprod",),  # the same tiles in ARM64's sdot (the dot-product extension)
    "q8 block tiles, i8mm": ("dotprod", "i8mm"),  # and in its smmla (the int8 matrix multiply), where it has it
    "prompt attention": ("avx512bf16",),  # prompt_attention.py: bfloat16 pairs, vdpbf16ps
}


# CODESPEC_CPU: run a lower instruction set on a higher CPU (tests, benches): the LLVM features it turns off, by prefix
LOWER = {"native": (), "avx2": ("avx512", "avxvnni", "amx")}


class MissingInstructions(RuntimeError):
    """A kernel needs instructions this CPU does not have (LLVM would abort the whole process compiling it)."""


@functools.cache
def host_has(feature: str) -> bool:
    """Whether this CPU has `feature` as LLVM names it ("avx512vnni", "avx512bf16", ...), or "openmp": numba runs its
    parallel loops on a pool that pays."""
    if feature == "openmp":
        return _pool_pays()
    return host_features().get(feature, False)


@functools.cache
def host_features() -> dict:
    """This CPU's features as LLVM names them ({name: bool}), less those CODESPEC_CPU turns off ({} without
    llvmlite, or on a target it does not know: the PyTorch paths instead)."""
    lowered = os.environ.get("CODESPEC_CPU", "native").lower()
    if lowered not in LOWER:
        from ...errors import CodespecError

        raise CodespecError(f"CODESPEC_CPU={lowered}: use one of {', '.join(LOWER)}")
    try:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        features = dict(llvm.get_host_cpu_features())
    except Exception:  # noqa: BLE001
        return {}
    return {name: have and not name.startswith(LOWER[lowered]) for name, have in features.items()}


def missing(kernel: str, have=None) -> list[str]:
    """What `kernel` needs that this CPU (or a CPU with the features `have`) lacks; [] when it can run."""
    return [feature for feature in NEEDS[kernel] if not (host_has(feature) if have is None else feature in have)]


@functools.cache
def available(kernel: str) -> bool:
    """Whether `kernel` runs here (asked on every forward by the drivers: kept)."""
    return not missing(kernel)


def check(kernel: str) -> None:
    """MissingInstructions, naming the features, where `kernel` cannot run here: before anything is compiled."""
    if available(kernel):
        return
    lacking = missing(kernel)
    if lacking:
        raise MissingInstructions(f"this CPU lacks {', '.join(lacking)}, which the {kernel} kernels need")


def _pool_pays() -> bool:
    """numba's parallel loops run on OpenMP (the system's libgomp, Debian's libgomp1) or TBB. Without either numba
    falls back to its workqueue, which wakes its threads too slowly for ~60 calls per forward: measured, 8 sequences
    x 1,450 tokens with two rows each took 147-178 ms against 98 ms with OpenMP and 144 ms with PyTorch's
    attention."""
    _parallel_sum(2)  # numba picks its pool at the first parallel region
    return numba.threading_layer() in ("omp", "tbb")


@numba.njit(fastmath=False, parallel=True, cache=True)
def _parallel_sum(count):
    total = 0
    for i in numba.prange(count):
        total += i
    return total
