"""The graph-safe forward for GPUs: every shape fixed, so that a tick of every session is one CUDA graph replay.

On a GPU a forward of a small model is bound by kernel launches, not by memory: the lean forward launches ~500
kernels at several microseconds each, where reading the default model's weights takes ~0.2 ms. A CUDA graph
replays a captured forward with one launch, but only if nothing in it changes shape or address. And a forward over
8 sessions x 16 rows costs about what one over 16 rows costs (the weights are read once): so a tick stacks every
session's rows into one forward. Here:

- every session's keys and values live in one pool, [layers, slots, kv_heads, length, head_dim], a slot each (the
  context plus one width, in whole blocks), taken from the pool's free slots and given back when the session goes;
  slot 0 is scratch, where padding sessions write. The pool doubles when it runs out (its graphs are captured
  again); where the device has no memory for that, DeviceMemoryFull (the engine evicts the idlest session);
- a generating forward runs `bucket x width` rows: each session's pending tokens and draft padded to `width`,
  the sessions padded to the next bucket (1, 2, 4, 8, 16) with scratch ones. Padding rows write keys past their
  session's length, where no query looks (each sees keys up to its own position) and the next forward writes
  again;
- the token ids, each session's start position and slot reach the device in one non-blocking copy from pinned
  memory; the rotary angles come from tables made once; attention reads each session's slot (ops.attend);
- the argmax of every row is taken inside the graph; a tick waits for the device once, when it reads the kept
  rows' argmax (greedy acceptance reads those targets).

The fixed shapes are also what keeps speculation lossless on a GPU. A GEMM kernel sums a row in its own order:
decoding one row at a time and verifying k+1 rows would round differently and sometimes pick another token. Here
every session's rows are `width` rows of every forward, and the operations (graph_ops.py) compute each row alike
whatever the other rows hold, so a token's logits are the same bits whether it was decoded alone, verified in a
draft or stacked with other sessions: greedy speculative output is identical to plain decoding in float32 and in
bfloat16 alike (tests/unit/test_graphs.py; on CUDA, codespec.bench.cuda).

Prompt chunks longer than a width run the same code at their own length, one session, without a graph (they are
compute-bound; plain and speculative decoding prefill alike). On a CPU the same forward runs without graphs (the
tests).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import CodespecError, DeviceMemoryFull
from .graph_ops import BLOCK, TorchOps, choose_ops
from .rows import Rows

WIDTH = 16  # rows of every session in a generating forward: pending tokens plus at most WIDTH - 1 draft tokens
BUCKETS = (1, 2, 4, 8, 16)  # sessions of a generating forward (each a graph): a tick's sessions, padded up
FIRST_SLOTS = 4  # sessions the pool holds before it first doubles


def bucket(sessions: int) -> int:
    """The stacked forward's size for this many sessions (at most the largest bucket a forward)."""
    return next(size for size in BUCKETS if size >= min(sessions, BUCKETS[-1]))


@dataclass
class Captured:
    """One bucket's graph: its inputs (token ids [bucket x width], then each session's start, then its slot) and
    outputs (logits [bucket x width, vocab] float32, their argmax), written by each replay."""

    graph: object  # torch.cuda.CUDAGraph, None where graphs are off
    inputs: torch.Tensor  # [bucket x (width + 2)] on the device
    logits: torch.Tensor | None = None
    targets: torch.Tensor | None = None


@dataclass
class Pool:
    """Every session's keys and values, a slot each: [layers, slots, kv_heads, length, dim]; slot 0 is scratch."""

    shape: tuple  # (layers, kv_heads, length, dim): one slot's
    dtype: torch.dtype
    device: torch.device
    keys: torch.Tensor = None
    values: torch.Tensor = None
    free: list = field(default_factory=list)  # slots no session holds

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def ready(self) -> None:
        """The pool's first slots, made where none are yet."""
        if self.keys is None:
            self._grow(FIRST_SLOTS + 1)

    def take(self) -> int:
        """A free slot; the pool doubles where there is none, or grows by one slot where the device has no memory
        for twice as many (DeviceMemoryFull where it has none for that either)."""
        if not self.free:
            self._grow(FIRST_SLOTS + 1) if self.keys is None else self._grow(2 * self.slots - 1, self.slots + 1)
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    def _grow(self, *sizes: int) -> None:
        """The pool at the first of `sizes` slots the device has memory for (its slots' keys and values copied)."""
        layers, kv_heads, length, dim = self.shape
        for slots in sizes:
            try:
                keys = self._allocate((layers, slots, kv_heads, length, dim))
                values = self._allocate((layers, slots, kv_heads, length, dim))
                break
            except torch.OutOfMemoryError:
                keys = values = None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # what the failed allocation left
        else:
            raise DeviceMemoryFull(f"no device memory for another session's cache ({self.slot_bytes() >> 20} "
                                   "MB): try again when other requests have finished")
        held = self.slots
        if held:
            keys[:, :held], values[:, :held] = self.keys, self.values
        self.keys, self.values = keys, values
        self.free[:0] = range(slots - 1, max(held, 1) - 1, -1)  # new slots, lowest taken first; slot 0 is scratch

    def _allocate(self, shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def slot_bytes(self) -> int:
        layers, kv_heads, length, dim = self.shape
        return 2 * layers * kv_heads * length * dim * self.dtype.itemsize


class SlotCache:
    """One session's cache (forward.StaticCache's interface): `length` tokens held, `crop` only moves it. Its slot
    goes back to the pool when the session lets go of it."""

    def __init__(self, pool: Pool, slot: int, context: int):
        self.pool, self.slot, self.context = pool, slot, context
        self.length = 0
        weakref.finalize(self, pool.give_back, slot)

    keys = property(lambda self: self.pool.keys[:, self.slot])  # [layers, kv_heads, length, dim] (a view)
    values = property(lambda self: self.pool.values[:, self.slot])
    shape = property(lambda self: tuple(self.pool.shape))  # (layers, kv_heads, length, dim)

    @property
    def capacity(self) -> int:
        return self.context

    def reserve(self, needed: int) -> None:
        if needed > self.context:
            raise CodespecError(f"{needed} tokens do not fit in the model's context of {self.context}")

    def crop(self, new_len: int) -> None:
        self.length = min(self.length, new_len)

    def changed(self, position: int) -> None:
        """(Nothing is kept about positions past the length.)"""

    @property
    def nbytes(self) -> int:
        return self.pool.slot_bytes()


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
    buckets = BUCKETS

    def __init__(self, lean, context: int, width: int = WIDTH, graphs: bool | None = None,
                 compiled: bool | None = None, ops: str | None = None):
        self.lean = lean
        self.config = lean.config
        self.device, self.dtype = lean.device, lean.dtype
        self.context, self.width = context, width
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.ops = choose_ops(self.device, ops, self.dtype)
        # long prompt chunks (their own length, no graph, compute-bound) in PyTorch's: Triton's attention holds a
        # session's rows in one program and would compile again for every chunk length
        self.prompt_ops = TorchOps()
        # torch.compile of the generating forward (fixed shapes: compiled once), meant to fuse a layer's small
        # kernels; measured on an H100 it made the graph slower (float32 4.3 -> 12.3 ms, bfloat16 3.6 -> 7.1 ms:
        # more kernels, not fewer), so it is off unless asked for (docs/benchmarks/cuda/forward-*.json)
        self.compiled = bool(compiled)
        self.step = torch.compile(self.forward, dynamic=False) if self.compiled else self.forward
        self.heads, self.kv_heads, self.head_dim = lean.heads, lean.kv_heads, lean.head_dim
        self.length = -(-(context + width) // BLOCK) * BLOCK  # keys a slot holds: room for a width past the context
        turns = lean._rotary(self.length)  # [length, dim / 2] complex
        self.cos, self.sin = turns.real.contiguous(), turns.imag.contiguous()  # float32 (float64 for float64)
        # logits in float32 at least, whatever the model's dtype: greedy ties and sampling see float32 scores
        wide = lean.dtype in (torch.float32, torch.float64)
        self.head = lean.lm_head.weight if wide else lean.lm_head.weight.float()
        # per layer: norm1, qkv, o, norm2, gate_up, down, as plain tensors (not oneDNN's packing on CPUs)
        projections = lean.projections
        self.layers = [(lean._norms[2 * i], *projections[4 * i : 4 * i + 2], lean._norms[2 * i + 1],
                        *projections[4 * i + 2 : 4 * i + 4]) for i in range(len(projections) // 4)]
        self.pool = Pool((len(self.layers), self.kv_heads, self.length, self.head_dim), self.dtype, self.device)
        self.captured: dict[int, Captured] = {}  # bucket -> its graph (captured again when the pool grows)
        self.reads = (f"graph-safe, width {width}, {self.ops.name} ops" + (", compiled" if self.compiled else "")
                      + (", CUDA graphs" if self.graphs else ""))

    @on_the_device
    def new_cache(self) -> SlotCache:
        slots = self.pool.slots
        slot = self.pool.take()
        if self.pool.slots != slots:
            self.captured.clear()  # graphs read the old pool's addresses
        return SlotCache(self.pool, slot, self.context)

    def cache_bytes(self) -> int:
        return self.pool.slot_bytes()

    def move(self, cache, source: int, target: int, count: int, into=None) -> None:
        self.lean.move(cache, source, target, count, into)

    @torch.no_grad()
    def __call__(self, cache: SlotCache, input_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        return self.batch([Rows(cache, input_ids, logits_to_keep)])[0]

    @torch.no_grad()
    @on_the_device
    def batch(self, rows: list) -> list[torch.Tensor]:
        """Every sequence's rows: long prompt chunks one by one at their own length, all the others stacked, a
        width of each sequence's rows a pass, up to the largest bucket of sequences a forward; then one wait for
        the device. Returns each sequence's logits for its last `keep` rows (float32, on the device)."""
        for r in rows:  # every row checked before any runs: a refused one leaves the others' caches as they were
            r.cache.reserve(r.cache.length + len(r.ids))
        kept: list[list] = [[] for _ in rows]  # each sequence's kept (logits, targets) pieces, in order
        stacked = []
        for index, r in enumerate(rows):
            if r.prompt and len(r.ids) > self.width:  # a prompt chunk: its own shapes, no graph
                kept[index].append((self._eager(r.cache, r.ids, r.keep), None))
            else:
                stacked.append(index)
        passes = max((-(-len(rows[i].ids) // self.width) for i in stacked), default=0)
        for first in range(0, passes * self.width, self.width):
            chunks = [(i, rows[i].ids[first : first + self.width]) for i in stacked if len(rows[i].ids) > first]
            for start in range(0, len(chunks), BUCKETS[-1]):
                self._stacked(rows, chunks[start : start + BUCKETS[-1]], first, kept)
        targets = [torch.cat([t for _, t in pieces]) for pieces in kept if pieces and pieces[0][1] is not None]
        host = torch.cat(targets).tolist() if targets else []  # the step's one wait for the device
        out = []
        for r, pieces in zip(rows, kept):
            logits = torch.cat([l for l, _ in pieces]) if len(pieces) > 1 else pieces[0][0]
            if pieces[0][1] is not None:
                r.targets, host = host[: logits.shape[0]], host[logits.shape[0] :]
            else:
                r.targets = None
            out.append(logits)
        return out

    def _stacked(self, rows: list, chunks: list, first: int, kept: list) -> None:
        """One generating forward over the chunks (sequence index, ids at most a width) of up to BUCKETS[-1]
        sequences, padded to a bucket: each sequence's kept rows go to kept[index]."""
        size, width = bucket(len(chunks)), self.width
        ids, starts, slots = [0] * (size * width), [0] * size, [0] * size  # padding: scratch slot 0, position 0
        for n, (index, chunk) in enumerate(chunks):
            cache = rows[index].cache
            ids[n * width : n * width + len(chunk)] = chunk
            starts[n], slots[n] = cache.length, cache.slot
        host = torch.tensor(ids + starts + slots, dtype=torch.long)
        captured = self._captured(size)
        captured.inputs.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)
        logits, targets = self._run(captured, size)
        for n, (index, chunk) in enumerate(chunks):
            r = rows[index]
            r.cache.length += len(chunk)
            later = len(r.ids) - first - len(chunk)  # the sequence's rows after this chunk
            wanted = min(len(chunk), max(0, r.keep - later))  # kept rows in this chunk
            if wanted:  # copied out of the graph's outputs, which the next replay writes again
                rows_kept = slice(n * width + len(chunk) - wanted, n * width + len(chunk))
                kept[index].append((logits[rows_kept].clone(), targets[rows_kept].clone()))

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
        captured = self._captured(1)
        starts = torch.arange(cache.length, cache.length + count, dtype=torch.long)
        starts = starts.pin_memory() if self.device.type == "cuda" else starts
        captured.inputs[self.width + 1] = cache.slot
        for step in range(count - 1):
            captured.inputs[:1].copy_(tokens[step : step + 1])
            captured.inputs[self.width : self.width + 1].copy_(starts[step : step + 1], non_blocking=True)
            tokens[step + 1 : step + 2].copy_(self._run(captured, 1)[1][:1])
            cache.length += 1
        return tokens.tolist()  # the wait

    @torch.no_grad()
    @on_the_device
    def scratch_forward(self, ids: list[int], size: int, start: int) -> None:
        """One generating forward of `size` sessions (ids: a width each) at position `start`, all on the scratch
        slot, which no session reads: what a bucket's forward costs (adaptive.BucketCosts). Waits for the device."""
        self.pool.ready()
        captured = self._captured(size)
        captured.inputs.copy_(torch.tensor(ids + [start] * size + [0] * size, dtype=torch.long))
        self._run(captured, size)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _eager(self, cache: SlotCache, ids: list[int], keep: int) -> torch.Tensor:
        """A prompt chunk at its own length: the logits of its last `keep` rows."""
        inputs = torch.tensor(ids + [cache.length, cache.slot], dtype=torch.long).to(self.device, non_blocking=True)
        logits, _ = self.forward(inputs, 1, len(ids), keep)
        cache.length += len(ids)
        return logits

    def _run(self, captured: Captured, size: int):
        """One generating forward of `size` sessions over the captured inputs: its graph's replay, or the forward
        itself. Returns the logits [size x width, vocab] and their argmax (a graph's outputs: the next replay
        writes them again)."""
        if captured.graph is not None:
            captured.graph.replay()
            return captured.logits, captured.targets
        return self.step(captured.inputs, size, self.width)

    def _captured(self, size: int) -> Captured:
        """The bucket's inputs and graph, captured on its first use. Warm-up and capture write keys into the scratch
        slot, which no session reads."""
        captured = self.captured.get(size)
        if captured is None:
            inputs = torch.zeros(size * (self.width + 2), dtype=torch.long, device=self.device)
            captured = self.captured[size] = Captured(None, inputs)
        if not self.graphs or captured.graph is not None:
            return captured
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # PyTorch's advice: run once on a side stream before capturing (compiles)
            try:
                self.step(captured.inputs, size, self.width)
            except Exception as error:  # torch.compile failed here (no compiler, an unsupported op): without it
                if not self.compiled:
                    raise
                warnings.warn(f"codespec: torch.compile of the graph-safe forward failed ({error}); without it")
                self.compiled, self.step = False, self.forward
                self.step(captured.inputs, size, self.width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured.logits, captured.targets = self.step(captured.inputs, size, self.width)
        captured.graph = graph
        return captured

    def forward(self, inputs: torch.Tensor, sessions: int, width: int, keep: int | None = None):
        """The forward over `sessions` sequences of `width` rows each: inputs holds their token ids [sessions x
        width], then each one's first position [sessions], then its slot [sessions] (tensors, so that a graph
        replays at any position and slot). Writes their keys and values into the pool; returns the logits of the
        last `keep` rows (all by default) [keep, vocab] (float32, or float64) and their argmax. Only tensor
        operations of fixed shapes."""
        lean, pool = self.lean, self.pool
        ops = self.ops if width <= self.width else self.prompt_ops
        rows = sessions * width
        starts, slots = inputs[rows : rows + sessions], inputs[rows + sessions : rows + 2 * sessions]
        positions = (starts[:, None] + torch.arange(width, device=self.device)).view(rows)  # [rows]
        row_slots = slots.repeat_interleave(width)  # [rows]
        x = F.embedding(inputs[:rows], lean.embed)  # [rows, hidden]
        h = ops.norm(x, self.layers[0][0], lean.eps)
        for layer, (_, qkv_w, o_w, norm2, gate_up_w, down_w) in enumerate(self.layers):
            qkv = ops.linear(h, qkv_w, lean.biases[layer])  # [rows, (heads + 2 kv_heads) dim]
            q = ops.rotate_and_store(qkv, self.cos, self.sin, positions, row_slots, pool.keys[layer],
                                     pool.values[layer], self.heads, self.kv_heads, lean.qk_norms[layer], lean.eps)
            attended = ops.attend(q, pool.keys[layer], pool.values[layer], slots, starts, width)  # [rows, heads dim]
            x, h = ops.add_norm(x, ops.linear(attended, o_w), norm2, lean.eps)
            mlp = ops.linear(ops.silu_mul(ops.linear(h, gate_up_w)), down_w)
            following = self.layers[layer + 1][0] if layer + 1 < len(self.layers) else lean.norm
            x, h = ops.add_norm(x, mlp, following, lean.eps)  # h: the next layer's input, or the output norm's
        h = h[rows - (keep or rows) :]  # [keep, hidden]
        # the output layer in the operations' GEMM too: a GPU BLAS picks its kernel by the row count, and a bucket of
        # 8 sessions would round a session's logits otherwise than the bucket of one
        logits = ops.linear(h.to(self.head.dtype), self.head)  # [keep, vocab]
        return logits, logits.argmax(-1)
