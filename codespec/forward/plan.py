"""How a model's forward runs here, decided once: a `ForwardPlan` resolved from the settings (ModelConfig's forward,
weights, activations, cache type, prompt precision, invariant) and from what this CPU can do (the kernels'
capability table, kernels/capabilities.py). Every check of those settings against each other, the model and the
CPU is in `resolve`; the forward builds what the plan says; the CLI prints it at start:

    codespec: forward lean, gguf blocks, q8 activations, f16 cache, AVX512-VNNI kernels
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..errors import CodespecError
from .kernels import attention, attention_tiles, block_tiles, capabilities, layers, q8_tiles
from .projections import bfloat16_pays


@dataclass(frozen=True)
class ForwardPlan:
    path: str  # "lean", "graphs" (the lean forward's weights, graph-safe, on GPUs) or "transformers"
    gguf: Optional[Path] = None  # the GGUF whose own blocks the projections multiply (lean, CPU, float32)
    weights: str = "checkpoint"  # what the projections read: "gguf blocks", "16 bits" (bfloat16 values), "checkpoint"
    activations: str = "float32"  # what the blocks multiply: "q8" (rounded to 8 bits) or "float32"
    cache: str = "f32"  # the KV cache's elements: "f16", "q8" or "f32" (the model's dtype)
    prompts: str = "float32"  # what long prompt chunks multiply: "float32" or "bfloat16"
    invariant: bool = False  # every forward in the per-row kernels: no row's bits depend on its batch
    cache_kernel: bool = False  # sequences of few rows attend in attention.py (numba's pool, float32 on a CPU)
    kernels: str = ""  # the CPU kernels' instruction set ("AVX512-VNNI", "AVX-512", "AVX2", ...); "": PyTorch's
    dtype: str = "float32"  # the model's (what an "f32" cache holds)

    def __str__(self) -> str:
        parts = [f"forward {self.path}", {"16 bits": "16-bit weights", "checkpoint": f"{self.dtype} weights"}.get(
            self.weights, self.weights)]
        if self.weights == "gguf blocks":
            parts.append(f"{self.activations} activations")
        parts.append(f"{self.dtype if self.cache == 'f32' else self.cache} cache")
        if self.prompts != "float32":
            parts.append(f"{self.prompts} prompts")
        if self.invariant:
            parts.append("batch-invariant")
        return ", ".join(parts + [f"{self.kernels or 'PyTorch'} kernels"])


def resolve(model, forward: str = "lean", gguf: Optional[Path] = None, prompt_precision: str = "float32",
            cache_type: str = "auto", activations: str = "auto", invariant: bool = False,
            graphs: Optional[bool] = None) -> ForwardPlan:
    """The plan for `model` with these settings on this machine, or a CodespecError naming the setting that cannot
    be honoured. forward: "lean" (the lean path where the model fits it) or "transformers". gguf: multiply that
    file's own blocks (--weights gguf). graphs: the lean path's graph-safe forward (None: on GPUs)."""
    direct = getattr(model, "gguf_direct", None)  # read from its GGUF directly (gguf_model.py): only its blocks
    gguf = gguf or direct
    graphs = model.device.type == "cuda" if graphs is None else graphs
    why = lean_unsupported(model) if forward != "transformers" else "--forward transformers"
    dtype = str(getattr(model, "dtype", "")).removeprefix("torch.")  # (a model of its own may have none)
    if why is not None:
        _transformers_refuse(why, gguf, cache_type, activations)
        return ForwardPlan("transformers", dtype=dtype)
    if graphs:
        if gguf is not None or cache_type in ("f16", "q8") or activations == "q8":
            raise CodespecError("the graph-safe forward (the lean forward on GPUs) keeps the cache in the model's "
                                "dtype and multiplies the checkpoint's weights: leave out --weights gguf, "
                                "--cache-type and --activations")
        return ForwardPlan("graphs", kernels="CUDA" if model.device.type == "cuda" else "", dtype=dtype)
    cpu32 = model.device.type == "cpu" and model.dtype == torch.float32
    if gguf is not None and not (cpu32 and layers.ready()):
        raise CodespecError("--weights gguf runs on CPUs in float32 (--device cpu --dtype float32), with numba's "
                            "OpenMP pool (the system's libgomp)")
    head_dim = head_size(model.config)
    q8 = q8_activations(activations, gguf)
    weights = "gguf blocks" if gguf is not None else ("16 bits" if cpu32 and sixteen_bits(model) else "checkpoint")
    cache_kernel = cpu32 and head_dim % 16 == 0 and attention.ready()
    invariant = invariant and gguf is not None and cache_kernel
    kernels = instruction_set() if weights != "checkpoint" or cache_kernel else ""
    cache = cache_of(cache_type, cache_kernel, q8, head_dim)
    if direct is not None and not invariant:
        raise CodespecError(f"{direct.name} is read directly (its blocks, no float weights), which runs every forward "
                            "in the block kernels: keep --invariant on, or add --weights checkpoint")
    return ForwardPlan("lean", gguf, weights, "q8" if q8 else "float32", cache,
                       prompts_of(prompt_precision, cpu32, q8, invariant), invariant, cache_kernel, kernels, dtype)


# rope types whose frequencies (and factor on cos and sin) are fixed when the model loads: the lean forward takes them
# from transformers' rotary module (Llama 3.x: llama3; others change with the sequence's length)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def lean_unsupported(model) -> Optional[str]:
    """None when the lean path computes the model's forward exactly, else why not."""
    config = model.config
    if config.model_type not in ("llama", "qwen2", "qwen3"):
        return f"model type {config.model_type!r}"
    attention_layer = model.model.layers[0].self_attn
    qkv_biased = {linear.bias is not None for linear in (attention_layer.q_proj, attention_layer.k_proj,
                                                         attention_layer.v_proj)}
    if getattr(config, "mlp_bias", False) or attention_layer.o_proj.bias is not None or len(qkv_biased) > 1:
        return "projection biases other than on q, k and v together"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") not in STATIC_ROPE:
        return f"rope type {rope.get('rope_type')!r}"
    return None


def q8_activations(activations: str, gguf: Optional[Path]) -> bool:
    """Whether the GGUF's blocks multiply activations rounded to 8 bits (q8; auto: on CPUs with AVX2, AVX512-VNNI or
    ARM64's dot product, whose tiles take every block type)."""
    if gguf is None:
        if activations == "q8":
            raise CodespecError("--activations q8 multiplies a GGUF's blocks: use it with --weights gguf (or auto)")
        return False
    if activations == "q8" and not q8_tiles.available():
        raise CodespecError("--activations q8 needs a CPU with AVX2, or an ARM64 CPU with the dot product (this one "
                            "has neither); use --activations float32")
    return activations != "float32" and q8_tiles.available()


def cache_of(cache_type: str, cache_kernel: bool, q8: bool, head_dim: int) -> str:
    """The KV cache's elements for --cache-type (auto: f16 wherever attention.py runs, else the model's dtype)."""
    if cache_type == "q8" and not (cache_kernel and q8 and head_dim % 64 == 0
                                   and attention_tiles.q8_instruction_set() is not None):
        raise CodespecError("--cache-type q8 runs where every forward runs in numba: with --weights gguf and "
                            "--activations q8, on a CPU with AVX2, AVX512-VNNI or ARM64's dot product (the cache's "
                            "scores), for head sizes that are a multiple of 64")
    if cache_type == "f16" and not cache_kernel:
        raise CodespecError("--cache-type f16 runs on CPUs in float32 (numba's OpenMP pool), with a head size "
                            "that is a multiple of 16")
    if cache_type == "auto":
        return "f16" if cache_kernel else "f32"
    return cache_type


def prompts_of(precision: str, cpu32: bool, q8: bool, invariant: bool) -> str:
    """What long prompt chunks multiply (--prompt-precision; auto: bfloat16 where it measures faster). Only on CPUs
    in float32, and not where every forward takes the per-row kernels (q8 activations, --invariant on)."""
    if precision == "bfloat16" and invariant:
        raise CodespecError("--prompt-precision bfloat16 multiplies prompts in PyTorch, whose bits depend on the "
                            "chunk; with --invariant on (the default) every forward takes the per-row kernels: "
                            "add --invariant off")
    if precision == "bfloat16" and q8:
        raise CodespecError("--prompt-precision bfloat16 multiplies prompts in PyTorch; with --activations q8 "
                            "(the default on this CPU) every forward takes the q8 tiles: add --activations float32")
    if not cpu32 or precision == "float32" or q8 or invariant:
        return "float32"
    return "bfloat16" if precision == "bfloat16" or bfloat16_pays(torch.backends.mkldnn.is_available()) else "float32"


def sixteen_bits(model) -> bool:
    """Whether every projection of a float32 model holds bfloat16 values (a converted checkpoint's), which the
    per-row kernels read as 16 bits, and those kernels run here."""
    projections = [model.lm_head.weight] + [linear.weight for layer in model.model.layers
                                            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                           layer.self_attn.v_proj, layer.self_attn.o_proj,
                                                           layer.mlp.gate_proj, layer.mlp.up_proj,
                                                           layer.mlp.down_proj)]
    return all(layers.exact(w) for w in projections) and layers.ready()


def auto_gguf(model, forward: str, source: Optional[Path]) -> Optional[Path]:
    """--weights auto: `source` (the GGUF the model came from, if any) when its blocks can run here: the lean
    forward on a CPU in float32, numba's pool, every projection in a block format the tiles read."""
    if source is None or forward != "lean" or lean_unsupported(model) is not None:
        return None
    if model.device.type != "cpu" or model.dtype != torch.float32 or not layers.ready():
        return None
    return None if block_tiles.unreadable(source) else source


def instruction_set() -> str:
    """The widest instruction set the CPU kernels use here, as a person would name it."""
    for feature, name in (("avx512vnni", "AVX512-VNNI"), ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("i8mm", "NEON-I8MM"),
                          ("neon", "NEON")):
        if capabilities.host_has(feature):
            return name
    return "portable"


def head_size(config) -> int:
    """A head's size: the config's head_dim, or (where it has none) hidden size over heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _transformers_refuse(why: str, gguf, cache_type: str, activations: str) -> None:
    if gguf is not None:
        raise CodespecError(f"--weights gguf runs on the lean forward (Llama and Qwen2 models), not here: {why}")
    if cache_type in ("f16", "q8"):
        raise CodespecError(f"--cache-type {cache_type} runs on the lean forward (Llama and Qwen2 models), not here: "
                            f"{why}")
    if activations == "q8":
        raise CodespecError(f"--activations q8 runs on the lean forward with --weights gguf, not here: {why}")
