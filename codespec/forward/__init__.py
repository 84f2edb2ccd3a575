"""Everything below the session: tokens in, logits out, keys and values kept in a session's cache.

- rows.py: what a forward reads and writes (`Rows`, one sequence's share; `StaticCache`, a session's KV cache);
- lean.py: the lean Llama/Qwen2 forward (CPU and GPU) and transformers' own (`TransformersForward`), and
  `forward_path`, which picks one for a model;
- graphs.py: the graph-safe forward on GPUs (fixed shapes, CUDA graphs);
- kernels/: the CPU kernels, numba and LLVM IR (the few-row layers, the GGUF's blocks, q8 activations, attention).

The engine and everything above it import from here, never from kernels/.
"""

from .lean import (LeanLlama, Linear, TransformersCache, TransformersForward, bfloat16_pays, blocks_can_run,
                   forward_path, q8_available, readable_blocks, run_layers)
from .rows import Rows, StaticCache

__all__ = ["LeanLlama", "Linear", "Rows", "StaticCache", "TransformersCache", "TransformersForward",
           "bfloat16_pays", "blocks_can_run", "forward_path", "q8_available", "readable_blocks", "run_layers"]
