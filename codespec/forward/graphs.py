"""The graph-safe forward for GPUs: every shape fixed, so that a decoding or verifying step is one CUDA graph replay.

On a GPU a forward of a small model is bound by kernel launches, not by memory: the lean forward launches ~500
kernels at several microseconds each, where reading the default model's weights takes ~0.2 ms. A CUDA graph
replays a captured forward with one launch, but only if nothing in it changes shape or address. So here:

- each session's keys and values live in a cache of fixed size (the context plus one width, in whole blocks),
  made once and handed to the next session when its session goes (with its captured graph);
- a generating forward always runs `width` rows: the session's pending tokens and draft, padded. Padding rows
  write keys past the session's length, where no query looks (each sees keys up to its own position) and the
  next forward writes again;
- positions come from a start the forward reads on the device, with the token ids, through one non-blocking copy
  from pinned memory; the rotary angles and the causal mask come from tables made once; attention reads the whole
  cache under the mask;
- the argmax of every row is taken inside the graph and copied back with the ids' next token: a step waits for
  the device once (`batch` ends with the one synchronisation), and greedy acceptance reads those targets.

The fixed shapes are also what keeps speculation lossless on a GPU. cuBLAS picks its kernel by the matrix's shape,
and each kernel sums a row in its own order: decoding one row at a time and verifying k+1 rows would round
differently and sometimes pick another token. Here every generating forward multiplies the same shapes, and a
GEMM sums each row alike whatever the other rows hold, so a token's logits are the same bits whether it was
decoded alone or verified in a draft, in any batch: greedy speculative output is identical to plain decoding
in float32 and in bfloat16 alike (tests/unit/test_graphs.py; on CUDA, codespec.bench.cuda).

Prompt chunks longer than a width run the same code at their own length without a graph (they are compute-bound;
plain and speculative decoding prefill alike). On a CPU the same forward runs without graphs (the tests).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import CodespecError, DeviceMemoryFull
from .rows import Rows

WIDTH = 16  # rows of every generating forward: pending tokens plus at most WIDTH - 1 draft tokens
BLOCK = 256  # keys per block of the attention's value products (a cache's size is a multiple of it)


@dataclass
class Captured:
    """A cache's graph: its inputs (token ids, then the start position) and outputs, with pinned host copies."""

    graph: object  # torch.cuda.CUDAGraph, None where graphs are off
    inputs: torch.Tensor  # [width + 1] on the device
    host_inputs: torch.Tensor  # [width + 1], pinned on CUDA
    logits: torch.Tensor | None = None  # [width, vocab] float32, written by each replay
    targets: torch.Tensor | None = None  # [width] argmax of each row
    host_targets: torch.Tensor | None = None  # [width], pinned on CUDA


class Store:
    """The tensors behind one cache: keys and values [layers, kv_heads, context + width, head_dim], and its graph."""

    def __init__(self, shape: tuple, dtype, device, width: int):
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        pinned = torch.device(device).type == "cuda"
        self.captured = Captured(None, torch.zeros(width + 1, dtype=torch.long, device=device),
                                 torch.zeros(width + 1, dtype=torch.long, pin_memory=pinned),
                                 host_targets=torch.zeros(width, dtype=torch.long, pin_memory=pinned))


class SlotCache:
    """One session's cache (forward.StaticCache's interface): `length` tokens held, `crop` only moves it. Its Store
    goes back to the forward's free list when the session lets go of it."""

    def __init__(self, store: Store, context: int, free: list):
        self.store = store
        self.context = context
        self.length = 0
        weakref.finalize(self, free.append, store)

    keys = property(lambda self: self.store.keys)
    values = property(lambda self: self.store.values)
    shape = property(lambda self: tuple(self.store.keys.shape))

    @property
    def capacity(self) -> int:
        return self.context

    def reserve(self, needed: int) -> None:
        if needed > self.context:
            raise CodespecError(f"{needed} tokens do not fit in the model's context of {self.context}")

    def crop(self, new_len: int) -> None:
        self.length = min(self.length, new_len)

    @property
    def nbytes(self) -> int:
        return self.store.keys.nbytes + self.store.values.nbytes


def on_the_device(method):
    """Run a method with the path's GPU current on this thread: streams, graphs and allocations without a device
    use the current one, which is per thread (the server's worker is not the thread that loaded the model)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)
    return run


class GraphLlama:
    """LeanLlama's weights in the graph-safe forward: `new_cache()`, `batch(rows)`, `__call__(cache, ids, keep)` and
    `move` as forward.LeanLlama; each generating Rows also gets `targets`, the argmax of its kept rows."""

    rewindable = True

    def __init__(self, lean, context: int, width: int = WIDTH, graphs: bool | None = None,
                 compiled: bool | None = None):
        self.lean = lean
        self.config = lean.config
        self.device, self.dtype = lean.device, lean.dtype
        self.context, self.width = context, width
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        # torch.compile of the generating forward (fixed shapes: compiled once), meant to fuse a layer's small
        # kernels; measured on an H100 it made the graph slower (float32 4.3 -> 12.3 ms, bfloat16 3.6 -> 7.1 ms:
        # more kernels, not fewer), so it is off unless asked for (docs/benchmarks/cuda/forward-*.json)
        self.compiled = bool(compiled)
        self.step = torch.compile(self.forward, dynamic=False) if self.compiled else self.forward
        self.heads, self.kv_heads, self.head_dim = lean.heads, lean.kv_heads, lean.head_dim
        self.length = -(-(context + width) // BLOCK) * BLOCK  # keys a cache holds: room for a width past the context
        self.rotary = lean._rotary(self.length)  # [length, half] complex
        self.key_positions = torch.arange(self.length, device=self.device)
        # logits in float32 at least, whatever the model's dtype: greedy ties and sampling see float32 scores
        wide = lean.dtype in (torch.float32, torch.float64)
        self.head = lean.lm_head.weight if wide else lean.lm_head.weight.float()
        # per layer: norm1, qkv, o, norm2, gate_up, down, as plain tensors (not oneDNN's packing on CPUs)
        projections = lean.projections
        self.layers = [(lean._norms[2 * i], *projections[4 * i : 4 * i + 2], lean._norms[2 * i + 1],
                        *projections[4 * i + 2 : 4 * i + 4]) for i in range(len(projections) // 4)]
        self.free: list[Store] = []
        self.reads = (f"graph-safe, width {width}" + (", compiled" if self.compiled else "")
                      + (", CUDA graphs" if self.graphs else ""))

    @on_the_device
    def new_cache(self) -> SlotCache:
        store = self.free.pop() if self.free else None
        if store is None:
            shape = (len(self.layers), self.kv_heads, self.length, self.head_dim)
            try:
                store = Store(shape, self.dtype, self.device, self.width)
            except torch.OutOfMemoryError:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # what the failed allocation left
                raise DeviceMemoryFull(f"no device memory for another session's cache ({self.cache_bytes() >> 20} "
                                       "MB): try again when other requests have finished") from None
        return SlotCache(store, self.context, self.free)

    def cache_bytes(self) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.length * self.head_dim * self.dtype.itemsize

    def move(self, cache, source: int, target: int, count: int, into=None) -> None:
        self.lean.move(cache, source, target, count, into)

    @torch.no_grad()
    def __call__(self, cache: SlotCache, input_ids: list[int], logits_to_keep: int) -> torch.Tensor:

        return self.batch([Rows(cache, input_ids, logits_to_keep)])[0]

    @torch.no_grad()
    @on_the_device
    def batch(self, rows: list) -> list[torch.Tensor]:
        """Each sequence's forward in turn (a graph replay each, on a GPU: the launches cost microseconds), then one
        wait for the device. Returns each sequence's logits for its last `keep` rows (float32, on the device)."""
        for r in rows:  # every row checked before any runs: a refused one leaves the others' caches as they were
            r.cache.reserve(r.cache.length + len(r.ids))
        results = []
        for r in rows:
            if r.prompt and len(r.ids) > self.width:  # a prompt chunk: its own shapes, no graph
                results.append((self._eager(r.cache, r.ids, r.keep), None))
            else:
                results.append(self._generate(r.cache, r.ids, r.keep))
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the step's one wait for the device
        out = []
        for r, (logits, targets) in zip(rows, results):
            r.targets = targets.tolist() if targets is not None else None
            out.append(logits)
        return out

    @torch.no_grad()
    @on_the_device
    def greedy(self, cache: SlotCache, ids: list[int], count: int) -> list[int]:
        """Feed ids, then decode `count` tokens greedily with count - 1 more forwards, without waiting for the device
        between them: each forward's argmax is the next one's input, copied on the device (a draft model's loop:
        two waits per draft, not two per token). The last token is not fed."""

        rows = Rows(cache, ids, 1)
        self.batch([rows])
        tokens = torch.empty(count, dtype=torch.long, device=self.device)
        tokens[0] = rows.targets[-1]
        captured = self._captured(cache.store)
        starts = torch.arange(cache.length, cache.length + count, dtype=torch.long)
        starts = starts.pin_memory() if self.device.type == "cuda" else starts
        for step in range(count - 1):
            captured.inputs[:1].copy_(tokens[step : step + 1])
            captured.inputs[self.width :].copy_(starts[step : step + 1], non_blocking=True)
            tokens[step + 1 : step + 2].copy_(self._run(cache.store)[1][:1])
            cache.length += 1
        return tokens.tolist()  # the wait

    def _eager(self, cache: SlotCache, ids: list[int], keep: int) -> torch.Tensor:
        """A prompt chunk at its own length: the logits of its last `keep` rows."""
        inputs = torch.tensor(ids + [cache.length], dtype=torch.long).to(self.device, non_blocking=True)
        logits, _ = self.forward(cache.store, inputs, len(ids), keep)
        cache.length += len(ids)
        return logits

    def _run(self, store: Store):
        """One generating forward over the store's inputs: its graph's replay, or the forward itself. Returns the
        logits [width, vocab] and their argmax [width] (a graph's outputs: the next replay writes them again)."""
        captured = self._captured(store)
        if captured.graph is not None:
            captured.graph.replay()
            return captured.logits, captured.targets
        return self.step(store, captured.inputs, self.width)

    def _generate(self, cache: SlotCache, ids: list[int], keep: int):
        """ids in forwards of `width` rows (padded): the kept rows' logits and their argmax (in host memory once
        the step has synchronised)."""
        captured = self._captured(cache.store)
        kept_logits, kept_targets = [], []
        for first in range(0, len(ids), self.width):
            chunk = ids[first : first + self.width]
            host = captured.host_inputs
            host[: len(chunk)] = torch.tensor(chunk, dtype=torch.long)
            host[len(chunk) : self.width] = 0  # padding rows: any token
            host[self.width] = cache.length
            captured.inputs.copy_(host, non_blocking=True)
            logits, targets = self._run(cache.store)
            cache.length += len(chunk)
            wanted = min(len(chunk), max(0, keep - (len(ids) - first - len(chunk))))  # kept rows in this chunk
            if wanted:
                # copied out of the graph's outputs, which the next replay writes again
                kept_logits.append(logits[len(chunk) - wanted : len(chunk)].clone())
                kept_targets.append(targets[len(chunk) - wanted : len(chunk)].clone())
        targets = torch.cat(kept_targets) if len(kept_targets) > 1 else kept_targets[0]
        host = captured.host_targets[: targets.shape[0]]
        if host.shape[0] < targets.shape[0]:  # more kept rows than one width: a host buffer for this call
            host = torch.empty_like(targets, device="cpu", pin_memory=self.device.type == "cuda")
        host.copy_(targets, non_blocking=True)
        return (torch.cat(kept_logits) if len(kept_logits) > 1 else kept_logits[0]), host

    def _captured(self, store: Store) -> Captured:
        """The store's graph, captured on its first use. Warm-up and capture write their keys at the positions
        past the context, which no session ever reads."""
        captured = store.captured
        if not self.graphs or captured.graph is not None:
            return captured
        captured.inputs.fill_(0)
        captured.inputs[self.width] = self.context
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # PyTorch's advice: run once on a side stream before capturing (compiles)
            try:
                self.step(store, captured.inputs, self.width)
            except Exception as error:  # torch.compile failed here (no compiler, an unsupported op): without it
                if not self.compiled:
                    raise
                warnings.warn(f"codespec: torch.compile of the graph-safe forward failed ({error}); without it")
                self.compiled, self.step = False, self.forward
                self.step(store, captured.inputs, self.width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured.logits, captured.targets = self.step(store, captured.inputs, self.width)
        captured.graph = graph
        return captured

    def forward(self, store: Store, inputs: torch.Tensor, count: int, keep: int | None = None):
        """The forward over `count` rows: inputs[:count] are the token ids, inputs[count] the position of the first
        (a tensor, so that a graph replays at any position). Writes their keys and values into the store; returns
        the logits of the last `keep` rows (all by default) [keep, vocab] (float32, or float64) and their argmax.
        Only tensor operations of fixed shapes."""
        lean = self.lean
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        group, hidden = heads // kv_heads, lean.hidden
        positions = inputs[count] + torch.arange(count, device=self.device)  # [count]
        x = F.embedding(inputs[:count], lean.embed)  # [count, hidden]
        rotary = self.rotary[positions][:, None, :]  # [count, 1, dim / 2]
        # query row i sees the keys at positions up to its own; one mask for every layer, repeated for the query
        # heads that share a key head: [group * count, keys]
        mask = torch.zeros((count, self.key_positions.shape[0]), dtype=self.dtype, device=self.device)
        mask.masked_fill_(self.key_positions[None, :] > positions[:, None], float("-inf"))
        mask = mask.repeat(group, 1)
        for layer, (norm1, qkv_w, o_w, norm2, gate_up_w, down_w) in enumerate(self.layers):
            h = F.rms_norm(x, (hidden,), norm1, lean.eps)
            qkv = F.linear(h, qkv_w, lean.biases[layer])  # [count, (heads + 2 kv_heads) dim]
            qk = qkv[:, : (heads + kv_heads) * dim].reshape(count, heads + kv_heads, dim // 2, 2)
            if lean.qk_norms[layer] is not None:  # (Qwen3's per-head norms)
                qk = (F.rms_norm(qk.reshape(count, heads + kv_heads, dim), (dim,), None, lean.eps)
                      * lean.qk_norms[layer]).reshape(count, heads + kv_heads, dim // 2, 2)
            turned = torch.view_as_complex(qk.float() if qk.dtype != torch.float64 else qk) * rotary
            qk = torch.view_as_real(turned).to(qkv.dtype).flatten(2)  # [count, heads + kv_heads, dim]
            v = qkv[:, (heads + kv_heads) * dim :].view(count, kv_heads, dim)
            keys, values = store.keys[layer], store.values[layer]  # [kv_heads, context + width, dim]
            keys.index_copy_(1, positions, qk[:, heads:].transpose(0, 1).to(keys.dtype))
            values.index_copy_(1, positions, v.transpose(0, 1).to(values.dtype))
            # the query heads of each key head as one matrix: [kv_heads, group * count, dim]
            q = qk[:, :heads].reshape(count, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)
            scores = torch.baddbmm(mask, q, keys.transpose(1, 2))  # [kv_heads, group * count, keys]
            probs = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(values.dtype)
            # the values' products a block of keys at a time, then summed over the blocks: one product over the
            # whole cache has a few rows and columns and thousands of terms each, which a GPU runs on a handful of
            # its cores (measured: 12 ms per forward in float32); the sum's order is fixed, so rows stay invariant
            blocks = self.length // BLOCK
            probs = probs.view(kv_heads, -1, blocks, BLOCK).transpose(1, 2).reshape(kv_heads * blocks, -1, BLOCK)
            partial = torch.bmm(probs, values.view(kv_heads * blocks, BLOCK, dim))  # [kv_heads blocks, rows, dim]
            attended = partial.view(kv_heads, blocks, group * count, dim).sum(1)  # [kv_heads, group * count, dim]
            attended = attended.view(kv_heads, group, count, dim).permute(2, 0, 1, 3).reshape(count, heads * dim)
            x = x + F.linear(attended, o_w)
            h = F.rms_norm(x, (hidden,), norm2, lean.eps)
            gate, up = F.linear(h, gate_up_w).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, down_w)
        x = x[count - (keep or count) :]  # [keep, hidden]
        logits = F.linear(F.rms_norm(x, (hidden,), lean.norm, lean.eps).to(self.head.dtype), self.head)  # [keep, vocab]
        return logits, logits.argmax(-1)
