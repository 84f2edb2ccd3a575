"""A GGUF read directly: no float32 copy of the model, no conversion into a checkpoint.

Where the lean forward runs every forward in the block kernels (a CPU in float32, --weights auto or gguf,
--invariant on: the defaults), the model's projections are never multiplied in PyTorch, so they need not exist as
float32 tensors. `load` then builds the model from the file's metadata (DirectModel: transformers' tree of parts
without its model classes) with each projection (and the embedding and output layer) a placeholder that holds no
memory (one zero, broadcast to the weight's shape); the norms and Qwen2's q/k/v biases, a few hundred KB, come from
the file. The lean forward reads the blocks from the
file (block_tiles.read_gguf) and looks embeddings up in the file's own blocks. The config and the tokenizer
(transformers builds both from the GGUF's `tokenizer.ggml.*` metadata) are saved beside the models the first time,
so a second load reads neither the vocabulary arrays nor any weight through transformers.

Measured on the default model (2-core AVX2 CPU): see docs/forward.md, "A GGUF read directly".

Where the lean or graph-safe forward multiplies float weights (a GPU or any device but the CPU, bfloat16 or any dtype
but float32, --forward graphs: models.float_gguf), `load_float` builds the same DirectModel with real weights: each
tensor dequantized (gguf.quants.dequantize, as transformers' GGUF loader does) CHUNK_VALUES values at a time,
Llama's q and k rows put back in the model's order (llama.cpp permutes them for its rope), cast to the dtype and
copied to the device, so that a load holds the model in its dtype on its device plus one chunk of float32 values,
never the model in float32 (transformers' GGUF loader: every tensor in float32 in host memory, then a transformers
model). Where the settings need transformers' own model (--forward transformers, from_pretrained's `extra`), or a
CPU in float32 takes the converted checkpoint's bfloat16 values (--weights checkpoint, --invariant off, bfloat16
prompts), or the file is another architecture, models.load converts the GGUF into a checkpoint as before."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from ..errors import CodespecError
from .kernels import block_tiles
from .kernels.block_tiles import field  # noqa: F401 (the file's metadata, re-exported: for the bench's zoo too)
from .plan import head_size

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


# A layer's parameters read as float weights (load_float) beside NAMES' small ones: llama.cpp's name -> transformers'
PROJECTIONS = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
               "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
               "attn_output.bias": "self_attn.o_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
               "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
FLOAT_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}  # (and per layer, NAMES and PROJECTIONS under blk.N.)
CHUNK_VALUES = 1 << 20  # values of a tensor dequantized at a time (load_float): 4 MB of float32


def float_problem(path: Path) -> Optional[str]:
    """Why `path` cannot be loaded with float weights from its own tensors (load_float: its architecture, a tensor
    type gguf cannot dequantize, a file gguf cannot parse), or None."""
    try:
        kind = block_tiles.architecture(path)
        tensors = block_tiles._reader(path).tensors
    except Exception as exc:  # gguf raises ValueError and others for a file it cannot parse
        return f"cannot read {path}: {exc}"
    if kind not in ARCHITECTURES:
        return f"architecture {kind!r} (read directly: {', '.join(ARCHITECTURES)})"
    names = {t.name for t in tensors}
    for name in ("token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        if name not in names:
            return f"no tensor {name}"
    for tensor in tensors:
        if not dequantizable(tensor.tensor_type):
            return f"{tensor.name} is {tensor.tensor_type.name}"
    return None


def dequantizable(kind) -> bool:
    """Whether gguf.quants.dequantize reads tensors of GGUF type `kind` (a GGMLQuantizationType)."""
    from gguf import quants

    return kind.name in ("F32", "F16") or kind in getattr(quants, "_type_traits", {})


def placeholder(shape) -> torch.nn.Parameter:
    """A float32 weight of `shape` that holds no memory: one zero, broadcast. Nothing multiplies it (the block
    kernels read the file); a path that would gets a model whose projections are all zero, so the plan refuses
    those paths (plan.resolve)."""
    return torch.nn.Parameter(torch.zeros(1).expand(*shape), requires_grad=False)


def saved_tokenizer(folder: Path, config):
    """The tokenizer saved in `folder`: where transformers saved it as its own class for a tokenizer.json
    (TokenizersBackend, as the default model's is), read without transformers (tokenizer.SavedTokenizer: importing
    transformers took ~1 s of every start). Other classes (Qwen2Tokenizer builds its pipeline anew, and encodes
    otherwise than the saved file read plainly) through AutoTokenizer."""
    from .tokenizer import SavedTokenizer, readable

    if readable(folder):
        return SavedTokenizer(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, config=config)


def metadata(path: Path, folder: Path):
    """(config, tokenizer) of the GGUF at `path`: from `folder` when saved there, else built by transformers from the
    file's metadata and saved there (the first load), then read back as a later load reads them, so that every load
    tokenizes alike. The config is a SavedConfig holding the saved fields: transformers' Llama and Qwen classes (and
    AutoConfig, and AutoTokenizer without a config) import torch.distributed.tensor and torch._dynamo, 1.7 s of every
    load, and transformers itself ~1 s."""
    stamp = folder / "source.json"
    if stamp.is_file():
        try:
            config = named(json.loads((folder / "config.json").read_text()), folder)
            return config, saved_tokenizer(folder, config)
        except Exception:  # a damaged copy: built again below
            pass
    from unittest import mock

    import gguf
    from transformers import AutoConfig, AutoTokenizer

    try:
        # transformers reads a Llama's or Qwen's config with gguf.GGUFReader, every element of the vocabulary's
        # arrays too (AutoConfig's read, and AutoTokenizer's again to pick a class: 10 of a 1.7B model's 27-second
        # first load); the config needs none of them, and the tokenizer reads its own with transformers' fast reader
        with mock.patch.object(gguf, "GGUFReader", block_tiles.arrays_skipped()):
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many types for unreadable or unsupported files
        raise CodespecError(f"cannot load GGUF {path}: {str(exc).splitlines()[0][:300]}") from None
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    if not config_dict.get("vocab_size"):  # (no {arch}.vocab_size: transformers counts the vocabulary, skipped above)
        config_dict["vocab_size"] = block_tiles.embedding_rows(path) or len(tokenizer)
    key_length = block_tiles.field(path, f"{block_tiles.architecture(path)}.attention.key_length")
    if key_length is not None:  # (transformers' mapping misses Qwen3's head size, wider than hidden / heads)
        config_dict["head_dim"] = int(key_length)
    config = AutoConfig.for_model(**config_dict)  # (every field, defaults included: what a later load reads)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        stamp.write_text(json.dumps({"gguf": str(path)}))
        tokenizer = saved_tokenizer(folder, config)
    except OSError:
        pass  # a read-only cache: built from the file again next time
    return named(config.to_dict(), folder), tokenizer


def named(fields: dict, folder: Path) -> "SavedConfig":
    """The saved `fields` as a config named by `folder` (one per GGUF) on the first load as on later ones: adaptive's
    cost table is kept per name, and a config built from the file carries the name of the file's own directory,
    which every GGUF in it shares (a first run measured the table under that name, the second run again under the
    folder's)."""
    return SavedConfig(**(fields | {"_name_or_path": str(folder)}))


class SavedConfig(SimpleNamespace):
    """A model's config as transformers saved it: its fields as attributes (what the plan and the lean forward read;
    a field it lacks raises AttributeError, so getattr's defaults apply), without transformers' config classes.
    transformers' own model of it (DirectModel.transformers, materialized) is built from `to_dict()`."""

    def to_dict(self) -> dict:
        return dict(vars(self))

    @property
    def name_or_path(self) -> str:
        return self._name_or_path


class Held(torch.nn.Module):
    """A part of the model read directly: only what it holds (transformers' attribute names, no forward of its own:
    the lean forward runs it)."""

    def __init__(self, **parts):
        super().__init__()
        for name, part in parts.items():
            setattr(self, name, part)


class Rotary(torch.nn.Module):
    """The rotary embedding's frequencies and its factor on cos and sin, as transformers' rotary modules compute them
    at load (the rope types plan.STATIC_ROPE names)."""

    def __init__(self, config):
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") == "default":
            dim = head_size(config)
            inv_freq, self.attention_scaling = 1.0 / (rope.get("rope_theta", 10000.0) ** (
                torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class DirectModel(torch.nn.Module):
    """A Llama, Qwen2 or Qwen3 model read directly from its GGUF: transformers' tree of parts
    (model.layers[i].self_attn.q_proj.weight, ...; what the plan and the lean forward read) with the projections
    placeholders, without transformers' model classes (importing them took 1.7 s of every load). direct False
    (load_float): the tree only, its weights to be filled in with the file's values; gguf_direct is then None (the
    forward multiplies the weights, not the blocks) and gguf_float the file."""

    def __init__(self, config, path: Path, direct: bool = True):
        super().__init__()
        # (the file the lean forward reads: plan.resolve takes it)
        self.config, self.gguf_direct = config, path if direct else None
        self.gguf_float = None if direct else path
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        head_dim = head_size(config)
        # q/k/v biases: Qwen2's always, the others' where the config says (and then on o too: the plan refuses that)
        biased = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        o_biased = config.model_type != "qwen2" and getattr(config, "attention_bias", False)

        def linear(outputs: int, inputs: int, bias: bool = False) -> Held:
            return Held(weight=placeholder((outputs, inputs)), bias=placeholder((outputs,)) if bias else None)

        def norm(size: int) -> Held:
            return Held(weight=torch.nn.Parameter(torch.ones(size), requires_grad=False))

        def layer() -> Held:
            q, kv, inner = heads * head_dim, kv_heads * head_dim, config.intermediate_size
            attention = Held(q_proj=linear(q, hidden, biased), k_proj=linear(kv, hidden, biased),
                             v_proj=linear(kv, hidden, biased), o_proj=linear(hidden, q, o_biased))
            if config.model_type == "qwen3":
                attention.q_norm, attention.k_norm = norm(head_dim), norm(head_dim)
            mlp = Held(gate_proj=linear(inner, hidden), up_proj=linear(inner, hidden), down_proj=linear(hidden, inner))
            return Held(self_attn=attention, mlp=mlp, input_layernorm=norm(hidden),
                        post_attention_layernorm=norm(hidden))

        self.model = Held(embed_tokens=Held(weight=placeholder((config.vocab_size, hidden))),
                          layers=torch.nn.ModuleList(layer() for _ in range(config.num_hidden_layers)),
                          norm=norm(hidden), rotary_emb=Rotary(config))
        self.lm_head = Held(weight=self.model.embed_tokens.weight if getattr(config, "tie_word_embeddings", False)
                            else placeholder((config.vocab_size, hidden)))

    def transformers(self):
        """transformers' model of this config holding this model's float weights (the same tensors: no copy), built
        on first use, for transformers' own forward: `forward` and `generate` below (Engine.transformers_model, the
        bench's transformers rows) on a model loaded with float weights (load_float). A model read directly has no
        float weights: `materialized` makes a float32 copy of the file's values for it."""
        if self.gguf_direct is not None:
            raise CodespecError(f"{self.gguf_direct.name} is read directly (its blocks, no float weights): "
                                "gguf_model.materialized gives transformers a float32 copy")
        shared = self.__dict__.get("_transformers")
        if shared is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.for_model(**self.config.to_dict())
            with torch.device("meta"):  # (no weights of its own: this model's are assigned below)
                shared = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
            shared.load_state_dict(dict(self.named_parameters(remove_duplicate=False)), strict=True, assign=True)
            rotary = type(shared.model.rotary_emb)  # (its frequencies are buffers no state dict holds: computed)
            shared.model.rotary_emb = rotary(config=shared.config).to(self.device)
            shared.eval()
            self.__dict__["_transformers"] = shared  # (not a submodule: its parameters are this model's)
        return shared

    def forward(self, *args, **kwargs):
        """transformers' forward (its model's outputs: .logits, ...) on these weights."""
        return self.transformers()(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """transformers' generate on these weights."""
        return self.transformers().generate(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        """The weights' device (the placeholders': the CPU)."""
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (the placeholders': float32)."""
        return self.model.embed_tokens.weight.dtype


def load(path: Path, folder: Path):
    """(model, tokenizer) for the GGUF at `path`: a DirectModel, its projections placeholders (the lean forward reads
    the file's blocks), its norms and biases from the file; `folder` keeps the config and tokenizer between loads."""
    config, tokenizer = metadata(path, folder)
    model = DirectModel(config, path)
    tensors = {t.name: t for t in block_tiles._reader(path).tensors}
    small = {"model.norm.weight": "output_norm.weight"} | {
        f"model.layers.{i}.{name}": f"blk.{i}.{gguf_name}"
        for i in range(config.num_hidden_layers) for gguf_name, name in NAMES.items()}
    for name, parameter in list(model.named_parameters()):
        if name not in small:
            continue
        if small[name] not in tensors:
            raise CodespecError(f"{path.name} has no tensor {small[name]} (for {name})")
        values = torch.from_numpy(np.array(tensors[small[name]].data, dtype=np.float32))
        if values.numel() != parameter.numel():
            raise CodespecError(f"{path.name}'s metadata does not match its tensors: {small[name]} has "
                                f"{values.numel()} values, the model its metadata describes {parameter.numel()}")
        parameter.data = values.reshape(parameter.shape)
    model.eval()
    torch.set_grad_enabled(False)
    return model, tokenizer


def load_float(path: Path, folder: Path, dtype: torch.dtype, device) -> Optional[tuple]:
    """(model, tokenizer) for the GGUF at `path` with float weights of `dtype` on `device`: a DirectModel (direct
    False) whose every parameter is the file's tensor (as transformers' GGUF loader gives it: gguf.quants.dequantize,
    Llama's q and k rows in the model's order) cast to `dtype`, read one tensor at a time, CHUNK_VALUES values at a
    time, each chunk copied to the device as soon as it is cast: the load holds the model in `dtype` on `device` and
    a chunk in float32, never the model in float32. The output layer is the embedding where the file has no
    output.weight. None where the lean forward does not run the model the metadata describes
    (plan.lean_unsupported: such a model runs transformers' own forward, on the converted checkpoint)."""
    from .plan import lean_unsupported

    config, tokenizer = metadata(path, folder)
    model = DirectModel(config, path, direct=False)
    if lean_unsupported(model) is not None:
        return None
    reader = block_tiles._reader(path)
    tensors = {t.name: t for t in reader.tensors}
    # llama.cpp's converter puts each Llama head's rotated pairs side by side; transformers' GGUF loader
    # (LlamaTensorProcessor._reverse_permute_weights) puts them back, as here
    permuted = block_tiles.architecture(path) == "llama"
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    sources = dict(FLOAT_NAMES) | {
        f"model.layers.{i}.{name}": f"blk.{i}.{gguf_name}" for i in range(config.num_hidden_layers)
        for gguf_name, name in (NAMES | PROJECTIONS).items()}
    modules = dict(model.named_modules())
    tied = "output.weight" not in tensors  # (transformers' GGUF config says tie_word_embeddings then)
    for name, parameter in list(model.named_parameters(remove_duplicate=False)):
        if name == "lm_head.weight" and tied:
            continue  # the embedding's, below
        source = sources.get(name)
        if source is None or source not in tensors:
            raise CodespecError(f"{path.name} has no tensor {source or name} (for {name})")
        part = source.split(".")[-2]
        order = None
        if permuted and part in heads:
            order = heads_order(parameter.shape[0], heads[part], f"{path.name}'s {source}")
        owner, leaf = name.rsplit(".", 1)
        values = dequantized(tensors[source], tuple(parameter.shape), dtype, device, order, path.name)
        setattr(modules[owner], leaf, torch.nn.Parameter(values, requires_grad=False))
        block_tiles.release(reader, tensors[source])  # (its pages of the mapped file: read, not needed again)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.to(device)  # (inv_freq stays float32, as transformers keeps it)
    model.eval()
    torch.set_grad_enabled(False)
    return model, tokenizer


def heads_order(rows: int, heads: int, what: str) -> torch.Tensor:
    """The file's row each model row of a Llama q or k tensor (bias) comes from: llama.cpp stores head h's rows
    (j, j + dim / 2) as rows 2j and 2j + 1; transformers' _reverse_permute_weights undoes that."""
    if rows % (2 * heads):
        raise CodespecError(f"{what} has {rows} rows, not a whole number of {heads} heads of rotated pairs")
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def dequantized(tensor, shape: tuple, dtype: torch.dtype, device, order: Optional[torch.Tensor] = None,
                file: str = "the file") -> torch.Tensor:
    """The values of GGUF `tensor` (gguf's ReaderTensor) as a tensor of `shape`, `dtype` on `device`: dequantized
    by gguf.quants.dequantize (float32, what transformers' GGUF loader takes) CHUNK_VALUES values at a time, each
    chunk cast on the host and copied to the device. order: model row i is the file's row order[i] (None: the
    file's order)."""
    from gguf import quants

    data = tensor.data  # (gguf's view of the mapped file: [rows, bytes of a row] for blocks, [rows, values] else)
    rows = shape[0]
    width = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    if int(tensor.n_elements) != rows * width or data.shape[0] != rows:
        raise CodespecError(f"{file}'s metadata does not match its tensors: {tensor.name} has "
                            f"{int(tensor.n_elements)} values, the model its metadata describes {rows * width}")
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(rows, width)
    targets = None if order is None else torch.argsort(order).to(out.device)  # the file's row r: model row targets[r]
    step = max(1, CHUNK_VALUES // width)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        values = np.asarray(quants.dequantize(data[start:stop], tensor.tensor_type), dtype=np.float32)
        if values.size != (stop - start) * width:
            raise CodespecError(f"{file}'s metadata does not match its tensors: {tensor.name}'s rows have "
                                f"{values.size // (stop - start)} values, the model's {width}")
        if not values.flags.writeable:  # (F32: a view of the read-only mapping)
            values = values.copy()
        chunk = torch.from_numpy(values.reshape(stop - start, width)).to(dtype)
        if targets is None:
            flat[start:stop].copy_(chunk)
        else:
            flat.index_copy_(0, targets[start:stop], chunk.to(out.device))
        del values, chunk
    return out


def materialized(model):
    """A float32 transformers model with the weights of the GGUF that `model` (read directly) reads: each the
    blocks' values, as the lean forward multiplies them. For transformers' own forward (the bench's transformers
    rows, the tests' reference); it takes the model's size in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = model.gguf_direct
    fields = model.config.to_dict()
    fresh = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=torch.float32)
    small = {name: p for name, p in model.named_parameters() if p.untyped_storage().nbytes() > 4}
    fresh.load_state_dict(small, strict=False)
    from .lean import rotary_order

    block_tiles.read_gguf(path, fresh, rotary_order(head_size(model.config)), 1.0,
                          permuted=block_tiles.architecture(path) == "llama")
    return fresh.eval()
