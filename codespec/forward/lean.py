"""The target forward: tokens in, logits out, keys and values kept in a per-session cache.

Two paths share one small interface (`new_cache()`, `__call__(cache, ids, logits_to_keep)`, `cache.length`,
`cache.crop(n)`):

- `LeanLlama` runs Llama-family models (SmolLM2, the default; Qwen2, whose q/k/v projections have biases)
  with a static, pre-allocated KV cache written by position, so rolling back rejected draft tokens is free: the
  length moves, nothing is copied. Each layer is a handful of large kernels: fused QKV and gate/up
  projections, rotary embedding as one complex multiply, grouped-query attention as one
  `scaled_dot_product_attention` call per sequence that reads the cache in place (`enable_gqa`; transformers'
  eager path copies the whole cache per layer to repeat the KV heads), and, on CPUs, weights pre-packed for
  oneDNN, whose small-batch GEMM is 2-4x faster here than the default BLAS for the 2-64 token verify forwards.
  The fused attention never writes the scores out: a 128-token prompt chunk against 2,900 cached tokens took
  21.7 ms per layer as two matmuls and a softmax, 7.2 ms fused (a 3,000-token prompt: 13.4 s -> 8.5 s).
  On CPUs in float32, sequences with at most attention.FEW_ROWS rows (decoding, verifies: what many sessions in
  one forward have) attend in one kernel call per layer that streams their caches instead (attention.py).
  Forwards over at most layers.FEW_ROWS rows leave PyTorch altogether: layers.py runs every layer in numba,
  reading a GGUF's own 4- and 8-bit blocks (block_tiles.py; the default model's, with --weights auto or gguf) or
  bfloat16-valued weights as 16 bits (the converted checkpoint's). Long prompt chunks (compute-bound) may take
  a copy of the projections in bfloat16 instead, in a forward of their own (--prompt-precision). With q8
  activations (q8_tiles.py; the default on x86 CPUs with AVX2) every forward runs in numba, prompts included, and
  every sequence but a prompt chunk attends in attention.py's kernel: verifies of any length are batch-invariant.
- `TransformersForward` (transformers_forward.py, imported only where it runs: transformers takes ~1 s to import)
  runs anything else through the model's own forward with transformers' cache, built so that a rollback works on
  every layer type (`TransformersCache`).

plan.py decides which path runs (and how); `build(plan, model)` makes it, `forward_path(model)` does both.
"""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path
from typing import List, Optional

import torch
import torch.nn.functional as F

from ..errors import CodespecError
from .kernels import attention, block_tiles, layers, prompt_attention, q8_tiles
from . import repacked
from .plan import ForwardPlan, lean_unsupported, resolve
from .projections import Linear, bfloat16_weight, project
from .rows import Rows, StaticCache


def rotary_order(head_dim: int) -> torch.Tensor:
    """Each head's rows reordered so that every rotated pair (i, i + head_dim / 2) sits side by side."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def qk_norm(attn, heads: int, kv_heads: int, order: torch.Tensor, scale: float) -> Optional[torch.Tensor]:
    """Qwen3's per-head q and k norm weights, one row per q head (times `scale`) then per k head, each reordered by
    `order` as the heads' rows are: [heads + kv_heads, head_dim]; None for a model without them."""
    if getattr(attn, "q_norm", None) is None:
        return None
    q, k = attn.q_norm.weight.detach()[order] * scale, attn.k_norm.weight.detach()[order]
    return torch.cat([q.expand(heads, -1), k.expand(kv_heads, -1)]).contiguous()


def reordered_qkv(attn, heads: int, kv_heads: int, head_dim: int, order: torch.Tensor, scale: float, bias: bool):
    """The q, k and v projections as one: the weights (or with bias=True their biases) of q and k with each head's
    rows reordered by `order`, and q's scaled by `scale`."""
    def part(linear, count):
        values = linear.bias if bias else linear.weight
        return values.view(count, head_dim, -1)[:, order].reshape(values.shape)
    return torch.cat([part(attn.q_proj, heads) * scale, part(attn.k_proj, kv_heads),
                      attn.v_proj.bias if bias else attn.v_proj.weight]).contiguous()


class LeanLlama:
    """A lean forward for Llama-architecture models (and Qwen2's, which adds q/k/v biases), sharing (not copying)
    the transformers weights."""

    INITIAL_CAPACITY = 1024
    rewindable = True  # crop() only moves the length

    @torch.no_grad()
    def __init__(self, model, plan: Optional[ForwardPlan] = None, **settings):
        """plan: what to run (plan.py's resolve); without one, resolved here from `settings` (resolve's)."""
        plan = plan or resolve(model, graphs=False, **settings)
        self.model = model  # (re-planned by the use_* switches)
        config = model.config
        self.config = config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.dtype = model.dtype
        self.device = model.device
        # Rotary embedding as a complex multiply needs each rotated pair adjacent: reorder the rows of the
        # q and k projections within every head from (0..half-1, half..dim-1) to interleaved pairs. Scores
        # q.k are unchanged because q and k are reordered alike. The 1/sqrt(head_dim) scale goes into W_q.
        order = rotary_order(self.head_dim)
        scale = 1.0 / math.sqrt(self.head_dim)
        # Qwen3 normalises each q and k head (RMSNorm over head_dim) before the rotation: the scale goes into the q
        # norm's weights instead, since a norm undoes any scale of its input
        self.qk_norms = [qk_norm(layer.self_attn, self.heads, self.kv_heads, order, scale)
                         for layer in model.model.layers]
        if self.qk_norms[0] is not None:
            scale = 1.0
        blocks = None  # --weights gguf: the file's own blocks, whose values replace the model's weights first
        self.gguf_source = (plan.gguf, model, order, scale)  # (read again where q8's repacked copies replaced them)
        # a model read directly from its GGUF (gguf_model.py) has no float weights: only the blocks' kernels run
        self.direct = getattr(model, "gguf_direct", None) is not None
        self.on_disk = self._from_disk(plan)  # its projections as the q8 tiles read them, kept by an earlier load
        self.keeper = None  # (the copy being written while a first load packs them)
        if plan.gguf is not None:  # (a direct model on q8 without a kept copy: each tensor repacked as it is read)
            packing = self.direct and self.on_disk is None and plan.activations == "q8"
            blocks = block_tiles.read_gguf(*self.gguf_source, projections=self.on_disk is None,
                                           each=self._packer() if packing else None)
        inner = model.model
        self.layer_count = len(inner.layers)
        self.embed = inner.embed_tokens.weight
        self.embed_blocks = blocks["embed"] if self.direct else None  # (embeddings looked up in the file's blocks)
        self.norm = inner.norm.weight
        self.lm_head = Linear(model.lm_head.weight) if not self.direct else None
        self.weights: list[torch.Tensor] = []  # per layer: norm1, qkv, o, norm2, gate_up, down (none when direct)
        self.biases: list[Optional[torch.Tensor]] = []  # per layer: the fused q/k/v bias (Qwen2), else None
        projections: list[torch.Tensor] = []  # per layer: the fused q/k/v, o, fused gate/up and down weights
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused = (attn, self.heads, self.kv_heads, self.head_dim, order, scale)
            self.biases.append(reordered_qkv(*fused, bias=True) if attn.q_proj.bias is not None else None)
            if self.direct:
                continue
            linears = [Linear(reordered_qkv(*fused, bias=False)), Linear(attn.o_proj.weight),
                       Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous()),
                       Linear(mlp.down_proj.weight)]
            qkv, o, gate_up, down = (linear.packed if linear.packed is not None else linear.weight
                                     for linear in linears)
            self.weights += [layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down]
            projections += [linear.weight for linear in linears]
        self.packed = self.lm_head is not None and self.lm_head.packed is not None
        self.projections = projections  # float32, for prompt_weights
        # forwards over few rows run in numba, reading bfloat16-valued weights as 16 bits (layers.py)
        # or, with --weights gguf, reading the GGUF's own 4- and 8-bit blocks (block_tiles.py)
        self._norms = [norm for layer in inner.layers for norm in (layer.input_layernorm.weight,
                                                                   layer.post_attention_layernorm.weight)]
        self.blocks = blocks
        self.plan: Optional[ForwardPlan] = None
        self.apply(plan)
        self._wide = torch.empty(0)  # see _batch
        self.run_layers = compiled_layers()
        # float32 angles and cos/sin, as transformers computes them (for every model dtype): its rotary module's
        # frequencies (rope scaling: llama3, linear and yarn change them once) and its factor on cos and sin (yarn's)
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float().cpu()
        self.rotary_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.rotary = self._rotary(self.INITIAL_CAPACITY)
        if self.kernel_weights is not None:
            self._warm()

    def _warm(self) -> None:
        """A prompt chunk and a decoding step on a scratch cache, so that numba loads every kernel a request takes
        (from its disk cache, or compiling them) now, not in the first request: that took ~0.9 s of its prefill."""
        cache = self.new_cache()
        self.batch([Rows(cache, [0] * (layers.FEW_ROWS + 1), 1, prompt=True)])
        self.batch([Rows(cache, [0], 1)])

    @staticmethod
    def supports(model) -> str | None:
        """None when this path computes the model's forward exactly, else why not."""
        return lean_unsupported(model)

    def apply(self, plan: ForwardPlan) -> None:
        """Run as `plan` says from now on (its gguf and path as this forward's own):
        - kernel_weights: what the per-row kernels read (layers.py): the GGUF's blocks, times activations rounded to
          8 bits (q8_tiles.py) or as they are (block_tiles.py), or the checkpoint's bfloat16 values as 16 bits;
        - few_rows_kernel: sequences of up to attention.FEW_ROWS rows attend in attention.py's kernel;
        - invariant: every forward in the per-row kernels, prompt chunks of any length too, so a row's numbers never
          depend on the rows beside it (its chunk, other sessions), nor does the text;
        - prompt_weights: long prompt chunks multiply bfloat16 copies of the projections, in a forward of their own
          (generated tokens and verified drafts always go through self.weights, so speculative and plain decoding
          still agree; what changes is a long prompt's cache, by bfloat16's rounding);
        - cache_dtype: the element type of caches made from now on."""
        previous, self.plan = self.plan, plan
        self.q8 = plan.activations == "q8"
        if previous is None or (previous.weights, previous.activations) != (plan.weights, plan.activations):
            # (built only when what the kernels read changes: the q8 tiles' repacked copies, ~0.7 s)
            # (__init__ asked the disk for this plan already; a replan asks again)
            kept = (self.on_disk if previous is None else self._from_disk(plan)) if self.q8 else None
            self.on_disk = None
            if kept is not None:  # repacked by an earlier load
                projections, head = kept[:-1], kept[-1]
            elif self.blocks is not None:
                if "layers" not in self.blocks:  # given up for q8's copies, or not read: read now
                    self.blocks = block_tiles.read_gguf(*self.gguf_source, each=self._packer() if self.q8 and
                                                        self.direct else None)
                # with q8 the repacked copies replace the blocks, each given up as it is repacked (layers.Weights):
                # a load holds one copy of the weights
                layered = self.blocks.pop("layers") if self.q8 else self.blocks["layers"]
                projections = [b for layer in layered for b in layer]
                head = self.blocks.pop("head") if self.q8 else self.blocks["head"]
                del layered
                if self.q8 and self.direct:  # repacked here (in place: each block goes), and kept for the next load
                    projections.append(head)
                    self._repacked(projections)
                    head = projections.pop()
            else:
                projections, head = list(self.projections), self.lm_head.weight  # (a list Weights consumes)
            self.kernel_weights = (layers.Weights(self._norms, self.biases, projections, self.norm, head, q8=self.q8,
                                                  qk_norms=self.qk_norms)
                                   if plan.weights != "checkpoint" else None)
        self.reads = {"gguf blocks": "gguf blocks, q8 activations" if self.q8 else "gguf blocks",
                      "16 bits": "16 bits"}.get(plan.weights, "float32")  # (the cost cache's key)
        self.few_rows_kernel = plan.cache_kernel
        self.invariant = plan.invariant
        self.prompt_weights: Optional[list[torch.Tensor]] = None
        if plan.prompts == "bfloat16":
            lows = (bfloat16_weight(w, self.packed) for w in self.projections)  # qkv, o, gate_up, down per layer
            self.prompt_weights = [w if i % 6 in (0, 3) else next(lows) for i, w in enumerate(self.weights)]
        self.cache_dtype = {"f16": torch.float16, "q8": torch.int8}.get(plan.cache, self.dtype)

    def _from_disk(self, plan: ForwardPlan) -> Optional[list[tuple]]:
        """The projections and output layer as q8_tiles.packed gave them to an earlier load of the same file (a model
        read directly, with q8 activations: forward/repacked.py), or None."""
        if not self.direct or plan.gguf is None or plan.activations != "q8" or q8_tiles.instruction_set() is None:
            return None
        kept = repacked.load(plan.gguf, q8_tiles.instruction_set(), self.gguf_source[3])
        return kept if kept is not None and len(kept) == 4 * len(self.model.model.layers) + 1 else None

    def _packer(self):
        """Blocks (or block_tiles.Mapped) -> what q8_tiles.packed makes of them for this CPU (a tuple, left as it
        is), each written at once into the copy kept for the next load (self.keeper: repacked.Keeper)."""
        isa = q8_tiles.instruction_set() or "avx2"  # (none: the tiles say what they lack when compiled, as repack)
        if self.keeper is None:
            self.keeper = repacked.Keeper(self.gguf_source[0], isa, self.gguf_source[3])
        keeper = self.keeper
        return lambda weight: keeper.add(weight.q8_packed(isa)) if hasattr(weight, "q8_packed") else weight

    def _repacked(self, weights: list) -> None:
        """Replace each of `weights` (blocks, or packed as read) with what q8_tiles.packed makes of it, so that each
        block is let go once repacked (a load holds one copy of the weights), and keep them on disk for the next
        load."""
        packer = self._packer()
        for i, weight in enumerate(weights):
            weights[i] = packer(weight)
        weights[:] = self.keeper.finish(weights)  # (mapped from the copy: the packed arrays go)
        self.keeper = None

    def replan(self, **changes) -> None:
        """This forward's plan with `changes` (resolve's settings), resolved and applied. A setting not changed that
        cannot go with the new ones (bfloat16 prompts, a q8 cache, after a switch to q8 or float32 activations)
        goes back to what always can (float32 prompts, the cache type auto picks)."""
        plan = self.plan
        kept = {"gguf": plan.gguf, "prompt_precision": plan.prompts, "cache_type": plan.cache,
                "activations": plan.activations if plan.gguf is not None else "auto", "invariant": plan.invariant}
        try:
            plan = resolve(self.model, graphs=False, **{**kept, **changes})
        except CodespecError:
            fallback = {"prompt_precision": "float32", "cache_type": "auto"}
            plan = resolve(self.model, graphs=False, **{**kept, **fallback, **changes})
        self.apply(plan)

    def use_prompt_precision(self, precision: str) -> None:
        """How prompt chunks over more than layers.FEW_ROWS rows are multiplied (ModelConfig.prompt_precision;
        plan.prompts_of)."""
        self.replan(prompt_precision=precision)

    def use_activations(self, activations: str) -> None:
        """What the GGUF's blocks multiply (ModelConfig.activations; plan.q8_activations)."""
        if self.blocks is None:
            raise CodespecError("--activations multiplies a GGUF's blocks: use it with --weights gguf (or auto)")
        self.replan(activations=activations)

    def use_cache_type(self, cache_type: str) -> None:
        """The element type of caches made from now on (ModelConfig.cache_type; plan.cache_of). f16: keys and values
        rounded to float16 as they are written, as llama.cpp keeps them by default; q8: each key and value (a head's
        64 numbers) rounded to 8-bit integers with one float32 scale, as llama.cpp's q8_0 cache types."""
        self.replan(cache_type=cache_type)

    def _rotary(self, positions: int) -> torch.Tensor:
        angles = torch.outer(torch.arange(positions, dtype=torch.float32), self.inv_freq)
        rotary = torch.complex(torch.cos(angles) * self.rotary_scaling, torch.sin(angles) * self.rotary_scaling)
        return rotary.to(torch.complex128 if self.dtype == torch.float64 else torch.complex64).to(self.device)

    @torch.no_grad()
    def move(self, cache: StaticCache, source: int, target: int, count: int,
             into: Optional[StaticCache] = None) -> None:
        """Move the cached keys and values of positions source.. to target.. (llama-server's --cache-reuse), within
        the cache (target < source) or into another one (`into`, with room for them): the keys are stored rotated
        by their position, so they are turned by the angle of the shift, in float64. The values move as they are.
        Only the rotary part is exact: the moved tokens keep the attention they had to the text that preceded
        them before, so their deeper layers differ from a recomputation (see Session.prepare)."""
        into = into if into is not None else cache
        if (into is cache and source == target) or count <= 0:
            return
        into.changed(target)
        angles = (target - source) * self.inv_freq.double()  # [half]
        turn = torch.polar(torch.ones_like(angles), angles).to(self.device)  # e^(i shift theta)
        if self.few_rows_kernel:  # on CPUs: numba, in place
            attention.move_cached(cache.keys, cache.values, source, target, count, turn, (into.keys, into.values))
            return
        for layer in range(cache.shape[0]):  # elsewhere (GPUs, other dtypes) PyTorch, a layer at a time
            keys = cache.keys[layer, :, source : source + count]  # [kv_heads, count, dim]
            turned = torch.view_as_complex(keys.double().unflatten(-1, (-1, 2))) * turn
            into.keys[layer, :, target : target + count] = torch.view_as_real(turned).flatten(-2)
            into.values[layer, :, target : target + count] = cache.values[layer, :, source : source + count].clone()

    def new_cache(self) -> StaticCache:
        return StaticCache(self.layer_count, self.kv_heads, self.head_dim, self.INITIAL_CAPACITY,
                           self.cache_dtype, self.device)

    @torch.no_grad()
    def __call__(self, cache: StaticCache, input_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        """Forward input_ids at positions cache.length..; returns logits for the last logits_to_keep."""
        return self.batch([Rows(cache, input_ids, logits_to_keep)])[0]

    @torch.no_grad()
    def batch(self, rows: list["Rows"]) -> list[torch.Tensor]:
        """Several sequences in one forward, each with its own cache. Their tokens are stacked into one matrix,
        so every weight is read once for all of them (on a CPU a forward costs about as much as reading the
        weights); only attention runs per sequence, against its own cache. One sequence is the same code.
        Long prompt chunks go through the weights for prompts (prompt_weights) in a forward of their own."""
        low = [self.prompt_weights is not None and r.prompt and len(r.ids) > layers.FEW_ROWS for r in rows]
        if not any(low) or all(low):
            return self._batch(rows, any(low))
        logits: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for flag in (True, False):
            chosen = [i for i, f in enumerate(low) if f == flag]
            for i, out in zip(chosen, self._batch([rows[i] for i in chosen], flag)):
                logits[i] = out
        return logits

    def _batch(self, rows: list["Rows"], prompt: bool) -> list[torch.Tensor]:
        starts = [r.cache.length for r in rows]
        counts = [len(r.ids) for r in rows]
        ends = [start + count for start, count in zip(starts, counts)]
        for r, end in zip(rows, ends):
            r.cache.reserve(end)
        if max(ends) > self.rotary.shape[0]:
            self.rotary = self._rotary(max(max(ends), 2 * self.rotary.shape[0]))
        ids = torch.tensor([t for r in rows for t in r.ids], dtype=torch.long, device=self.device)
        x = (self.embed_blocks.take(ids.numpy()) if self.embed_blocks is not None
             else F.embedding(ids, self.embed))  # [rows, hidden]
        rotary = torch.cat([self.rotary[start:end] for start, end in zip(starts, ends)])[:, None, :]  # [rows, 1, half]
        # sequences of up to attention.FEW_ROWS rows take the cache-streaming kernel (attention.py): on CPUs in float32;
        # with q8 activations every sequence but prompt chunks, so that a verify of any length matches decoding bit
        # for bit (q8's rounding would turn PyTorch's last-bit differences into visible ones)
        few = [self.few_rows_kernel and (count <= attention.FEW_ROWS or (self.q8 and not r.prompt) or self.invariant)
               for count, r in zip(counts, rows)]
        table, score_rows, width = None, 0, 0
        if any(few):
            chosen = [i for i, f in enumerate(few) if f]
            firsts = list(itertools.accumulate(counts, initial=0))
            table = attention.make_table([rows[i] for i in chosen], [firsts[i] for i in chosen], self.heads)
            score_rows = self.heads * sum(counts[i] for i in chosen)
            width = attention.padded_width(max(ends[i] for i in chosen))
        # prompt chunks attend in prompt_attention's bfloat16 tiles with q8 activations (which run every forward in
        # numba), where the CPU has them; they mask each row by its own length
        bfloat16 = self.q8 and self.kernel_weights is not None and prompt_attention.fits(self.head_dim) and not self.invariant
        masks: List[Optional[torch.Tensor]] = []
        for start, count, end, kernel in zip(starts, counts, ends, few):
            mask = None
            if count > 1 and not kernel and start > 0 and not bfloat16:  # query i sees keys 0..start+i (0: is_causal)
                key_positions = torch.arange(end, device=self.device)
                query_positions = torch.arange(start, end, device=self.device)[:, None]
                mask = torch.zeros((count, end), dtype=self.dtype, device=self.device)
                mask.masked_fill_(key_positions > query_positions, float("-inf"))
            masks.append(mask)
        keep = [i for row_end, r in zip(itertools.accumulate(counts), rows) for i in range(row_end - r.keep, row_end)]
        wide = None  # a float16 cache read by PyTorch's attention widens into this buffer, kept between forwards
        apart_ends = [end for end, kernel in zip(ends, few) if not kernel]
        widened = self.cache_dtype == torch.int8 or not bfloat16  # (the tiles read a float16 cache themselves)
        if self.cache_dtype != self.dtype and apart_ends and widened:  # (q8: the dequantized keys and values)
            needed = 2 * self.kv_heads * max(apart_ends) * self.head_dim
            if self._wide.numel() < needed:
                self._wide = torch.empty(max(needed, 2 * self._wide.numel()), dtype=self.dtype, device=self.device)
            wide = self._wide
        # every layer in numba: forwards over few rows, and with q8 activations all (the other path's float32
        # activations would give other logits: a verify over more rows would not match decoding)
        if self.kernel_weights is not None and (self.q8 or self.invariant or len(ids) <= layers.FEW_ROWS):
            firsts = itertools.accumulate(counts, initial=0)
            apart = [layers.Apart(first, count, r.cache, mask, wide, bfloat16)
                     for first, count, r, mask, kernel in zip(firsts, counts, rows, masks, few) if not kernel]
            logits = layers.forward(self.kernel_weights, x, rotary, table, score_rows, width, apart, keep, self.eps,
                                     self.heads, self.kv_heads, self.head_dim)
        else:
            x = self.run_layers(x, [r.cache.keys for r in rows], [r.cache.values for r in rows], rotary, masks,
                                starts, counts, few, table, score_rows, width,
                                self.prompt_weights if prompt else self.weights, self.biases, self.qk_norms, self.packed,
                                self.eps, self.heads, self.kv_heads, self.head_dim, wide)
            logits = self.lm_head(F.rms_norm(x[keep], (self.hidden,), self.norm, self.eps))  # [sum of keep, vocab]
        for r, end in zip(rows, ends):
            r.cache.length = end
            if not r.prompt:  # decoding: the prompt's kept layouts go (as many bytes as the cache)
                r.cache.laid = None
        return list(logits.split([r.keep for r in rows]))


def run_layers(x: torch.Tensor, keys_all: List[torch.Tensor], values_all: List[torch.Tensor], rotary: torch.Tensor,
               masks: List[Optional[torch.Tensor]], starts: List[int], counts: List[int], few: List[bool],
               table: Optional[torch.Tensor], score_rows: int, width: int, weights: List[torch.Tensor],
               biases: List[Optional[torch.Tensor]], qk_norms: List[Optional[torch.Tensor]], packed: bool, eps: float,
               heads: int, kv_heads: int, dim: int, wide: Optional[torch.Tensor]) -> torch.Tensor:
    """Every decoder layer over x [rows, hidden]: sequence s has counts[s] rows at positions starts[s].. and
    its own cache (keys_all[s], values_all[s]), where its keys and values are written. Sequences marked in `few`
    attend in one call of attention.cached_attention per layer (described by `table`; `score_rows` query heads
    against up to `width` keys), the others in one scaled_dot_product_attention each. One plain function (no
    modules, no hooks) so that TorchScript can run it without Python."""
    hidden = x.shape[1]
    for index in range(len(weights) // 6):
        norm1, qkv_w, o_w = weights[6 * index], weights[6 * index + 1], weights[6 * index + 2]
        norm2, gate_up_w, down_w = weights[6 * index + 3], weights[6 * index + 4], weights[6 * index + 5]
        h = torch.rms_norm(x, [hidden], norm1, eps)
        qkv = project(h, qkv_w, packed, biases[index])  # [rows, (heads + 2 kv_heads) dim]
        qk = qkv[:, : (heads + kv_heads) * dim].reshape(x.shape[0], heads + kv_heads, dim // 2, 2)
        qk_norm = qk_norms[index]
        if qk_norm is not None:  # (Qwen3's per-head norms)
            qk = (torch.rms_norm(qk.reshape(x.shape[0], heads + kv_heads, dim), [dim], None, eps)
                  * qk_norm).reshape(x.shape[0], heads + kv_heads, dim // 2, 2)
        if qk.dtype == torch.bfloat16 or qk.dtype == torch.float16:  # no complex bf16, and complex32 has few
            # kernels: rotate in float32 (as transformers does) and come back to the model's dtype
            qk = torch.view_as_real(torch.view_as_complex(qk.float()) * rotary).to(qkv.dtype).flatten(2)
        else:
            qk = torch.view_as_real(torch.view_as_complex(qk) * rotary).flatten(2)  # [rows, heads + kv_heads, dim]
        attended = torch.empty((x.shape[0], heads * dim), dtype=x.dtype, device=x.device)
        row = 0
        v = qkv[:, (heads + kv_heads) * dim :].view(x.shape[0], kv_heads, dim)
        for s in range(len(counts)):
            count = counts[s]
            if not few[s]:
                attended[row : row + count] = attention.attend_in_place(
                    qk[row : row + count, :heads], qk[row : row + count, heads:], v[row : row + count],
                    keys_all[s][index], values_all[s][index], starts[s], masks[s], wide)
            row += count
        if table is not None:  # the others write their keys and values and attend in one call
            torch.ops.codespec.cached_attention(qk, v, attended.view(x.shape[0], heads, dim), table, index, heads,
                                                kv_heads, score_rows, width)
        x = x + project(attended, o_w, packed, None)
        h = torch.rms_norm(x, [hidden], norm2, eps)
        gate, up = project(h, gate_up_w, packed, None).chunk(2, dim=-1)
        x = x + project(F.silu(gate).mul_(up), down_w, packed, None)
    return x


_COMPILED = []


def compiled_layers():
    """run_layers under TorchScript, which runs the ~40 small operations per layer without the Python
    interpreter (about 5 ms less per forward of the default model on 2 CPU cores); plain Python when
    TorchScript is unavailable."""
    if not _COMPILED:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TorchScript announces its deprecation
                _COMPILED.append(torch.jit.script(run_layers))
        except Exception:  # any failure to script leaves the same function, interpreted
            _COMPILED.append(run_layers)
    return _COMPILED[0]


def q8_available() -> bool:
    """Whether this CPU has the instructions the q8 activations' kernels need (AVX2 or AVX512-VNNI)."""
    return q8_tiles.available()


def forward_path(model, lean: bool = True, gguf: Optional[Path] = None, prompt_precision: str = "float32",
                 cache_type: str = "auto", activations: str = "auto", graphs: Optional[bool] = None,
                 context: int = 0, invariant: Optional[bool] = None):
    """The forward for `model` with these settings (plan.resolve's; lean=False: transformers' forward). invariant
    None: on for a model read directly from its GGUF (which runs nothing else), else off."""
    if invariant is None:
        invariant = getattr(model, "gguf_direct", None) is not None
    plan = resolve(model, "lean" if lean else "transformers", gguf, prompt_precision, cache_type, activations,
                   invariant, graphs)
    return build(plan, model, context)


def build(plan: ForwardPlan, model, context: int = 0):
    """The forward `plan` says: the lean path, its graph-safe form (context: its cache size, 0 for the model's
    context), or transformers' own."""
    if plan.path == "graphs":
        from .graphs import GraphLlama

        context = context or int(getattr(model.config, "max_position_embeddings", 2048))
        return GraphLlama(LeanLlama(model, cache_type="f32", prompt_precision="float32"), context)
    if plan.path == "lean":
        return LeanLlama(model, plan)
    from .transformers_forward import TransformersForward

    return TransformersForward(model)
