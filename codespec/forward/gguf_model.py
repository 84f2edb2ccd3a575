"""A GGUF read directly: no float32 copy of the model, no conversion into a checkpoint.

Where the lean forward runs every forward in the block kernels (a CPU in float32, --weights auto or gguf,
--invariant on: the defaults), the model's projections are never multiplied in PyTorch, so they need not exist as
float32 tensors. `load` then builds the transformers model from the file's metadata with each projection (and the
embedding and output layer) a placeholder that holds no memory (one zero, broadcast to the weight's shape); the
norms and Qwen2's q/k/v biases, a few hundred KB, come from the file. The lean forward reads the blocks from the
file (block_tiles.read_gguf) and looks embeddings up in the file's own blocks. The config and the tokenizer
(transformers builds both from the GGUF's `tokenizer.ggml.*` metadata) are saved beside the models the first time,
so a second load reads neither the vocabulary arrays nor any weight through transformers.

Measured on the default model (2-core AVX2 CPU): see docs/forward.md, "A GGUF read directly". Where the settings need float weights
(--weights checkpoint, --invariant off, bfloat16 prompts, a GPU, another dtype) or the file is another architecture,
models.load converts the GGUF into a checkpoint as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..errors import CodespecError
from .kernels import block_tiles
from .kernels.block_tiles import field  # (the file's metadata: for the bench's zoo too)

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # the GGUF architectures read directly (the lean forward's)
NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
         "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
         "attn_k_norm.weight": "self_attn.k_norm.weight"}  # the small tensors read from the file, per layer


def direct_problem(path: Path) -> Optional[str]:
    """Why `path` cannot be read directly (its architecture, a tensor type the tiles do not read, a file gguf
    cannot parse), or None."""
    try:
        kind = block_tiles.architecture(path)
    except Exception as exc:  # gguf raises ValueError and others for a file it cannot parse
        return f"cannot read {path}: {exc}"
    if kind not in ARCHITECTURES:
        return f"architecture {kind!r} (read directly: {', '.join(ARCHITECTURES)})"
    names = {t.name for t in block_tiles._reader(path).tensors}
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        if name not in names:
            return f"no tensor {name}"
    return block_tiles.unreadable(path)


def placeholder(shape) -> torch.nn.Parameter:
    """A float32 weight of `shape` that holds no memory: one zero, broadcast. Nothing multiplies it (the block
    kernels read the file); a path that would gets a model whose projections are all zero, so the plan refuses
    those paths (plan.resolve)."""
    return torch.nn.Parameter(torch.zeros(1).expand(*shape), requires_grad=False)


def metadata(path: Path, folder: Path):
    """(config, tokenizer) of the GGUF at `path`: from `folder` when saved there, else built by transformers from the
    file's metadata and saved there (the first load)."""
    from transformers import AutoConfig, AutoTokenizer

    stamp = folder / "source.json"
    if stamp.is_file():
        try:
            return AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
        except Exception:  # a damaged copy: built again below
            pass
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many types for unreadable or unsupported files
        raise CodespecError(f"cannot load GGUF {path}: {str(exc).splitlines()[0][:300]}") from None
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    key_length = block_tiles.field(path, f"{block_tiles.architecture(path)}.attention.key_length")
    if key_length is not None:  # (transformers' mapping misses Qwen3's head size, wider than hidden / heads)
        config_dict["head_dim"] = int(key_length)
    config = AutoConfig.for_model(**config_dict)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        stamp.write_text(json.dumps({"gguf": str(path)}))
    except OSError:
        pass  # a read-only cache: built from the file again next time
    return config, tokenizer


def load(path: Path, folder: Path):
    """(model, tokenizer) for the GGUF at `path`, its projections placeholders (the lean forward reads the file's
    blocks), its norms and biases from the file; `folder` keeps the config and tokenizer between loads."""
    from transformers import AutoModelForCausalLM

    config, tokenizer = metadata(path, folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {t.name: t for t in block_tiles._reader(path).tensors}
    small = {"model.norm.weight": "output_norm.weight"} | {
        f"model.layers.{i}.{name}": f"blk.{i}.{gguf_name}"
        for i in range(config.num_hidden_layers) for gguf_name, name in NAMES.items()}
    for name, parameter in list(model.named_parameters()):
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        if name in small:
            if small[name] not in tensors:
                raise CodespecError(f"{path.name} has no tensor {small[name]} (for {name})")
            values = torch.from_numpy(np.array(tensors[small[name]].data, dtype=np.float32))
            if values.numel() != parameter.numel():
                raise CodespecError(f"{path.name}'s metadata does not match its tensors: {small[name]} has "
                                    f"{values.numel()} values, the model its metadata describes {parameter.numel()}")
            values = values.reshape(parameter.shape)
            setattr(module, attribute, torch.nn.Parameter(values, requires_grad=False))
        else:
            setattr(module, attribute, placeholder(parameter.shape))
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.device("cpu"):  # (its buffers were made on the meta device)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise CodespecError(f"reading {path.name} directly left {', '.join(left[:3])} unmade: use --weights checkpoint")
    model.gguf_direct = path  # the file the lean forward reads (plan.resolve takes it as --weights gguf)
    model.eval()
    torch.set_grad_enabled(False)
    return model, tokenizer


def materialized(model):
    """A float32 transformers model with the weights of the GGUF that `model` (read directly) reads: each the
    blocks' values, as the lean forward multiplies them. For transformers' own forward (the bench's transformers
    rows, the tests' reference); it takes the model's size in float32."""
    from transformers import AutoModelForCausalLM

    path = model.gguf_direct
    fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    small = {name: p for name, p in model.named_parameters() if p.untyped_storage().nbytes() > 4}
    fresh.load_state_dict(small, strict=False)
    from .lean import rotary_order

    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    block_tiles.read_gguf(path, fresh, rotary_order(head_dim), 1.0, permuted=block_tiles.architecture(path) == "llama")
    fresh.generation_config = model.generation_config
    return fresh.eval()
