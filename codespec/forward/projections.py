"""A projection's matrix product on the PyTorch path: the weight pre-packed for oneDNN where that runs, and the
bfloat16 copies long prompt chunks may multiply (--prompt-precision), with the measurement that decides whether
they pay on this CPU. lean.py's layers and plan.py's choice of prompt precision both use these."""

from __future__ import annotations

import functools
import math
import time
from typing import List, Optional, Union

import torch
import torch.nn.functional as F


class Linear:
    """y = x @ W.T, with the weight pre-packed for oneDNN when that is available (fp32 on CPU)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.packed = None
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            except (AttributeError, RuntimeError):  # a build without these ops: plain BLAS it is
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


def project(x: torch.Tensor, weight: torch.Tensor, packed: bool, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ W.T (+ bias), from the weight pre-packed for oneDNN (packed) or plain. A weight in a narrower dtype
    (LeanLlama.prompt_weights) takes x rounded to it and gives its float32 sums back in x's dtype."""
    dtype = x.dtype
    narrow = weight.dtype != dtype
    if narrow:
        x = x.to(weight.dtype)
    if packed and weight.is_mkldnn:  # (a bfloat16 weight oneDNN could not pack on this CPU is plain)
        no_scalars: List[Optional[Union[int, float, complex]]] = []
        y = torch.ops.mkldnn._linear_pointwise(x, weight, None if narrow else bias, "none", no_scalars, "")
    else:
        y = F.linear(x, weight, None if narrow else bias)
    if narrow:
        y = y.to(dtype)
        if bias is not None:
            y = y + bias
    return y


def bfloat16_weight(weight: torch.Tensor, packed: bool) -> torch.Tensor:
    """A projection's weight rounded to bfloat16, pre-packed for oneDNN when the float32 ones are and this CPU's
    oneDNN packs bfloat16 (else plain: PyTorch's bfloat16 GEMM)."""
    weight = weight.to(torch.bfloat16)
    return torch.ops.mkldnn._reorder_linear_weight(weight) if packed and bfloat16_packs() else weight


@functools.cache
def bfloat16_packs() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU (it needs avx512bw/vl/dq or avx_ne_convert)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
        return True
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def bfloat16_pays(packed: bool, rows: int = 128, size: int = 1024) -> bool:
    """Whether a prompt chunk's projection runs at least 1.4x faster in bfloat16 than in float32 on this CPU
    (with AVX512-BF16 or AMX: about 2x; without, bfloat16 is emulated and slower), timed once per process."""
    x, weight = torch.randn(rows, size), torch.randn(size, size)
    timings = []
    for candidate in (bfloat16_weight(weight, packed), Linear(weight).packed if packed else weight):
        best = math.inf
        for _ in range(5):
            started = time.perf_counter()
            project(x, candidate, packed, None)
            best = min(best, time.perf_counter() - started)
        timings.append(best)
    return timings[0] * 1.4 <= timings[1]
