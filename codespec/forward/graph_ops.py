"""The operations of the graph-safe forward (graphs.py), one call each, in two implementations with one interface:

- `TorchOps`: PyTorch's kernels (CPUs, and GPUs without Triton). A layer is ~25 kernels on a GPU.
- `TritonOps` (kernels/triton_ops.py): fused Triton kernels for GPUs, ~10 a layer, attention reading only the
  filled part of each session's cache. Chosen on CUDA where Triton imports (it ships with PyTorch's CUDA wheels).

Both keep what makes speculation lossless with several sessions in one forward: a row's bits never depend on the
other rows of the forward (its session's, or other sessions'), so a token decoded alone, verified in a draft or
stacked with seven other sessions gets the same logits. PyTorch's kernels give that here because every GEMM keeps
its shapes per row block (on a CPU, measured: 16 rows alone and the first 16 of 256 are the same bits); where a
GPU's BLAS picks a kernel by the row count it may not, which is what TritonOps' fixed tiles are for.

Layouts: a layer's cache pool `keys`/`values` is [slots, kv_heads, length, head_dim]; q is pre-scaled by
1/sqrt(head_dim) (lean.py folds it into the q weights); q and k pairs (2i, 2i+1) rotate together (lean.py's
reordered rows)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..errors import CodespecError

BLOCK = 256  # keys per block of the attention's value products (a cache's length is a multiple of it)


class TorchOps:
    """The reference: PyTorch's kernels, which every device has."""

    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)  # [M, N]

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
        """The residual stream after adding delta, and its norm for the next part."""
        x = x + delta
        return x, self.norm(x, weight, eps)

    def rotate_and_store(self, qkv, cos, sin, positions, slots, keys, values, heads: int, kv_heads: int,
                         qk_norm, eps: float) -> torch.Tensor:
        """Turns each row's q and k heads by its position's angles (after Qwen3's per-head norms), writes its k and
        v heads into row m's slot at its position, and returns the turned q heads [M, heads, dim]."""
        rows, dim = qkv.shape[0], keys.shape[-1]
        qk = qkv[:, : (heads + kv_heads) * dim].reshape(rows, heads + kv_heads, dim)
        if qk_norm is not None:
            qk = F.rms_norm(qk, (dim,), None, eps) * qk_norm
        pairs = (qk.float() if qk.dtype != torch.float64 else qk).view(rows, heads + kv_heads, dim // 2, 2)
        c, s = cos[positions][:, None].to(pairs.dtype), sin[positions][:, None].to(pairs.dtype)  # [M, 1, dim / 2]
        a, b = pairs[..., 0], pairs[..., 1]
        turned = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(2).to(qkv.dtype)  # [M, heads + kv, dim]
        # (advanced indices around a slice: the [M] dimension goes first, [M, kv_heads, dim] as written)
        keys[slots, :, positions] = turned[:, heads:].to(keys.dtype)
        values[slots, :, positions] = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim).to(values.dtype)
        return turned[:, :heads]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attend(self, q, keys, values, slots, starts, width: int) -> torch.Tensor:
        """Session b's `width` rows (q[b * width:][:width], at positions starts[b]..) attend to the keys of its slot
        up to their own positions: [B * width, heads * dim]. The whole fixed cache is read under a mask."""
        rows, heads, dim = q.shape
        sessions, kv_heads, length = slots.shape[0], keys.shape[1], keys.shape[2]
        group = heads // kv_heads
        cached_keys, cached_values = keys[slots], values[slots]  # [B, kv_heads, length, dim] (copies)
        # the query heads of each key head as one matrix: [B, kv_heads, group * width, dim]
        q = q.view(sessions, width, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(sessions, kv_heads, -1, dim)
        positions = starts[:, None] + torch.arange(width, device=q.device)  # [B, width]
        hidden = torch.arange(length, device=q.device)[None, None, :] > positions[:, :, None]  # [B, width, length]
        mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
        scores = torch.matmul(q, cached_keys.transpose(-1, -2)) + mask.repeat(1, group, 1)[:, None]
        probs = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(values.dtype)
        # the values' products a block of keys at a time, then summed over the blocks in order: one product over
        # the whole cache has a few rows and thousands of terms each, which a GPU runs on a handful of its cores
        blocks = length // BLOCK
        probs = probs.view(sessions * kv_heads, -1, blocks, BLOCK).transpose(1, 2).reshape(-1, group * width, BLOCK)
        partial = torch.bmm(probs, cached_values.reshape(-1, BLOCK, dim))  # [B kv_heads blocks, group width, dim]
        attended = partial.view(sessions, kv_heads, blocks, group, width, dim).sum(2)
        return attended.permute(0, 3, 1, 2, 4).reshape(rows, heads * dim)


TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what TritonOps multiplies (float64: PyTorch's)


def choose_ops(device: torch.device, choice: str | None = None, dtype: torch.dtype = torch.float32):
    """The operations for a model's device and dtype: "torch", "triton", or None for the best there (Triton's on
    CUDA where it imports, for TRITON_DTYPES; $CODESPEC_GRAPH_OPS overrides)."""
    choice = choice or os.environ.get("CODESPEC_GRAPH_OPS") or None
    if choice == "torch" or (choice is None and (device.type != "cuda" or dtype not in TRITON_DTYPES)):
        return TorchOps()
    if choice not in (None, "triton"):
        raise CodespecError(f"graph ops {choice!r}: torch or triton")
    try:
        from .kernels.triton_ops import TritonOps
    except ImportError as error:
        if choice == "triton":
            raise CodespecError(f"the Triton kernels need triton ({error})") from None
        return TorchOps()
    return TritonOps()
