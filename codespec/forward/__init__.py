"""Everything below the session: tokens in, logits out, keys and values kept in a session's cache.

- rows.py: what a forward reads and writes (`Rows`, one sequence's share; `StaticCache`, a session's KV cache);
- plan.py: `ForwardPlan`, how the forward runs here, resolved once from the settings and the CPU's capabilities
  (every check of the settings is there), printed at start;
- lean.py: the lean Llama/Qwen2 forward (CPU and GPU), and `build`, which makes the one a plan says
  (`forward_path`: resolve, then build);
- transformers_forward.py: transformers' own (`TransformersForward`, `TransformersCache`), imported on first use
  (transformers takes ~1 s to import; a GGUF read directly runs without it);
- graphs.py: the graph-safe forward on GPUs (fixed shapes, CUDA graphs);
- kernels/: the CPU kernels, numba and LLVM IR (the few-row layers, the GGUF's blocks, q8 activations, attention),
  with their capability table (capabilities.py), IR vocabulary (ir.py) and native calls (native.py).

The engine and everything above it import from here, never from kernels/.
"""

from .kernels.layers import FEW_ROWS  # forwards over at most this many rows run in the per-row kernels
from .lean import LeanLlama, build, forward_path, q8_available, run_layers
from .plan import ForwardPlan, auto_gguf, resolve
from .projections import Linear, bfloat16_pays
from .rows import Rows, StaticCache

__all__ = ["FEW_ROWS", "ForwardPlan", "LeanLlama", "Linear", "Rows", "StaticCache", "TransformersCache", "TransformersForward",
           "auto_gguf", "bfloat16_pays", "build", "forward_path", "q8_available", "resolve", "run_layers"]


def __getattr__(name: str):
    """TransformersForward and TransformersCache, imported when first asked for (with transformers)."""
    if name in ("TransformersCache", "TransformersForward"):
        from . import transformers_forward

        return getattr(transformers_forward, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
