"""GGUF files written by the tests: a tiny model's weights in any block type (gguf's encoder, or tests/kquants.py's for
the K-quants gguf cannot write), laid out as llama.cpp's converter lays them out, and random blocks in a tile layout."""

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Type
from gguf import quants

from codespec.forward.kernels import block_tiles
from tests.kquants import encode


def random_blocks(kind: str, outputs: int, inputs: int, seed: int = 0) -> block_tiles.Blocks:
    """Blocks of tile layout `kind` with random integers, scales and minimums (float16 values, as files have)."""
    rng = np.random.default_rng(seed)
    layout = block_tiles.KINDS[kind]
    shape = (outputs, inputs // 32, layout.scales)
    scales = (rng.random(shape) * 0.1).astype(np.float16).astype(np.float32)
    minimums = (rng.random(shape) - 0.5).astype(np.float16).astype(np.float32)
    low = -128 if layout.bits == 8 else -layout.offset
    q = rng.integers(low, low + (1 << layout.bits), (outputs, inputs // 32, 32))
    return block_tiles.Blocks.of(kind, q, scales, minimums if layout.minimum else None)


def quantize(weight: np.ndarray, kind: Type) -> np.ndarray:
    """A file's raw blocks of `weight`: gguf's own encoder, or tests/kquants.py's for the K-quants it cannot write."""
    if kind.name.endswith("_K"):
        return encode(weight, kind.name)
    return quants.quantize(weight, kind)


def llama_cpp_order(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert script: each Llama head's rotated pairs side by side."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def tensor(path, name: str):
    """The GGUF tensor `name` of the file at `path`."""
    return next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)


def write_gguf(path, model, permute: bool, projections=Type.Q4_1, output=Type.Q8_0):
    """The model's weights quantised into a GGUF laid out as llama.cpp writes one (q/k permuted for Llama).
    projections: a type, or a function of the tensor's name giving one."""
    writer = gguf.GGUFWriter(str(path), model.config.model_type)  # (general.architecture)
    add_weights(writer, model, permute, projections, output)
    return close(writer, path)


def add_weights(writer, model, permute: bool, projections=Type.Q4_1, output=Type.Q8_0, tied: bool = False):
    """The model's tensors, in a GGUF writer, as write_gguf lays them out; tied: no output.weight (the output layer is
    the embedding)."""
    config = model.config

    def add(name, weight, kind):
        kind = kind(name) if callable(kind) else kind  # (a type per tensor, as llama-quantize's mixes give)
        writer.add_tensor(name, quantize(weight.detach().float().numpy(), kind), raw_dtype=kind)

    def plain(name, values):  # norms and biases, float32 as llama.cpp's converter keeps them
        writer.add_tensor(name, values.detach().float().numpy().copy())

    add("token_embd.weight", model.model.embed_tokens.weight, output)
    if not tied:
        add("output.weight", model.lm_head.weight, output)
    plain("output_norm.weight", model.model.norm.weight)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k = attn.q_proj.weight, attn.k_proj.weight
        if permute:
            q, k = llama_cpp_order(q, config.num_attention_heads), llama_cpp_order(k, config.num_key_value_heads)
        plain(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        plain(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        if getattr(attn, "q_norm", None) is not None:  # (Qwen3's per-head norms)
            plain(f"blk.{i}.attn_q_norm.weight", attn.q_norm.weight)
            plain(f"blk.{i}.attn_k_norm.weight", attn.k_norm.weight)
        if attn.q_proj.bias is not None:  # (Qwen2's, in the model's order: llama.cpp permutes Llama's only)
            for name, linear in (("attn_q", attn.q_proj), ("attn_k", attn.k_proj), ("attn_v", attn.v_proj)):
                plain(f"blk.{i}.{name}.bias", linear.bias)
        for name, weight in (("attn_q", q), ("attn_k", k), ("attn_v", attn.v_proj.weight),
                             ("attn_output", attn.o_proj.weight), ("ffn_gate", mlp.gate_proj.weight),
                             ("ffn_up", mlp.up_proj.weight), ("ffn_down", mlp.down_proj.weight)):
            add(f"blk.{i}.{name}.weight", weight, projections)


def close(writer, path):
    """The writer's header, metadata and tensors to the file; its path."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def k_quant_model(kind: str):
    """A tiny random model wide enough for the K-quants' 256-weight super-blocks (hidden 256, 4 heads of 64)."""
    import transformers

    from tests.tiny import VOCAB, tiny_config

    shape = {**tiny_config(VOCAB, 512), "hidden_size": 256, "intermediate_size": 512}
    config = transformers.Qwen2Config(**shape) if kind == "qwen2" else transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    model = (transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.LlamaForCausalLM)(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
    return model.float().eval()


def q4_k_m(name: str) -> Type:
    """llama-quantize's Q4_K_M mix, in small: Q4_K, with v and down in Q6_K in every other layer."""
    return Type.Q6_K if any(f"blk.{i}.{part}" in name for i in (0,) for part in ("attn_v", "ffn_down")) else Type.Q4_K
