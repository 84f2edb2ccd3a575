"""A GGUF's own 4-bit and 8-bit weights in the few-row forward (`--weights gguf`, and `auto`, the default, on
CPUs in float32): a quarter of the bytes.

The default model ships as a Q4_1 GGUF (every layer's projections; the tied embedding and output layer in Q8_0),
which is what llama-server runs. `codespec pull` stores it as bfloat16, which rounds those values; with
`--weights gguf` codespec runs the file's own numbers instead:

- **The blocks as they are.** Q4_1 keeps 32 weights as 4-bit q with a float16 scale d and minimum m
  (w = q * d + m), Q8_0 as signed 8-bit q with a scale (w = q * d). The projections keep q as the file has it
  (66 MB for the default model's layers, against 212 MB as 16 bits); d and m are widened to float32.
- **Or activations rounded to 8 bits** (--activations q8, the default on CPUs with AVX512-VNNI): q8_tiles.py repacks
  these blocks for its integer kernels; the float tiles below are then not built.
- **The float32 weights are the same numbers.** The model's float32 parameters are overwritten with the
  dequantised blocks (each q * d + m rounded once, as the kernel's fused multiply-add rounds it), so forwards over
  more rows (prompts, long verifies in PyTorch) and the kernel multiply by the same weights. A q/k scale that is
  not a power of two (head_dim not a power of 4) rounds the kernel's q weights once more than PyTorch's.
- **Kernels in LLVM IR.** numba leaves the nibble unpacking scalar, so the kernel is written as LLVM IR with
  explicit 16-wide vectors and compiled by llvmlite (numba's own LLVM, a wheel: no compiler) for this CPU when
  the model loads (0.1 s). A tile computes one output column for up to four rows; each (row, column) is the same
  sequence of operations in every tile: per block, w = fma(q, d, m) and two 16-lane sums a += w * x, then
  the two sums added and halved down to one number in a fixed order. So a row's projections do not depend on
  which rows share its forward (`tests/unit/test_block_tiles.py`), and neither does attention over the cache
  (attention.py): a verify forward of up to 16 rows gives each row the logits of one-token forwards, bit for bit.

The numba driver (`linear`) runs chunks of 16 output columns per thread, as many rows at a time as a tile takes (four,
three, two or one with AVX-512's 32 vector registers; two or one with AVX2's 16), so that each unpacked block serves
several rows.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numba
import numpy as np
import torch
from numba import prange

from . import capabilities
from .ir import FMA, FMA_DECLARATION, VECTOR
from .native import call, compile_ir
from ...errors import CodespecError

KINDS = {"Q4_1": (16, True), "Q8_0": (32, False)}  # bytes of q per 32-weight block, whether it has a minimum


def tile_rows(wide_registers: bool) -> np.ndarray:
    """The rows of each tile, one output column each, most first. A row's two 16-lane sums take two of AVX-512's 32
    registers, but four of AVX2's 16: there the 3- and 4-row tiles spill sums to the stack in the loop (the 4-row
    Q4_1 tile: 23 stack accesses against the 2-row's 3, its arguments), and a forward over 16 rows took 64-88 ms
    with 2-row tiles against 79-102 ms with 4-row ones (the default model, 4 alternating runs each). On AVX-512,
    measured: 8 rows were no faster; a forward over 3 rows took two passes (2 + 1 rows), 13.8 ms at 300 cached
    tokens, and 9.8 ms with the 3-row tile; two or four columns no faster, and four columns of the Q8_0 output
    layer 2.2x slower."""
    return np.array([4, 3, 2, 1] if wide_registers else [2, 1])


ROWS = tile_rows(capabilities.available("four-row block tiles"))  # (numba's cache keeps a compiled driver per CPU: it reads ROWS)
CHUNK = 16  # output columns a thread takes at a time



def _splat(name: str, value: str) -> str:
    return (f"  %{name}.1 = insertelement {VECTOR} poison, float {value}, i64 0\n"
            f"  %{name} = shufflevector {VECTOR} %{name}.1, {VECTOR} poison, <16 x i32> zeroinitializer\n")


def _lanes(first: int, last: int) -> str:
    return ", ".join(f"i32 {i}" for i in range(first, last))


def _sum(name: str, a: str, b: str) -> str:
    """%name = the 32 lanes of a and b added: a + b, then halves added down to one, in a fixed order."""
    text, width, source = f"  %{name}.16 = fadd {VECTOR} {a}, {b}\n", 16, f"%{name}.16"
    while width > 1:
        half = width // 2
        for side, lanes in (("a", _lanes(0, half)), ("b", _lanes(half, width))):
            text += (f"  %{name}.{half}{side} = shufflevector <{width} x float> {source}, <{width} x float> poison, "
                     f"<{half} x i32> <{lanes}>\n")
        text += f"  %{name}.{half} = fadd <{half} x float> %{name}.{half}a, %{name}.{half}b\n"
        source, width = f"%{name}.{half}", half
    return text + f"  %{name} = extractelement <1 x float> %{name}.1, i64 0\n"


def _block(kind: str, rows: int) -> str:
    """One block of 32 weights (block %b) into the sums %a{j}_s{h}: w = q * d + m as two halves of 16
    lanes, then for each row j: a += w * x (one fused multiply-add per half)."""
    block, minimum = KINDS[kind]
    text = f"  %qbb = mul i64 %b, {block}\n  %qpb = getelementptr i8, ptr %q0, i64 %qbb\n"
    if minimum:  # Q4_1: byte i holds weight i (low nibble) and weight 16 + i (high nibble)
        text += (f"  %qvb = load <16 x i8>, ptr %qpb, align 1\n  %qwb = zext <16 x i8> %qvb to <16 x i32>\n"
                 f"  %lob = and <16 x i32> %qwb, splat (i32 15)\n  %hib = lshr <16 x i32> %qwb, splat (i32 4)\n"
                 f"  %qb0 = uitofp <16 x i32> %lob to {VECTOR}\n  %qb1 = uitofp <16 x i32> %hib to {VECTOR}\n")
    else:  # Q8_0: 32 signed bytes
        text += (f"  %qvb = load <32 x i8>, ptr %qpb, align 1\n  %qwb = sext <32 x i8> %qvb to <32 x i32>\n"
                 f"  %qfb = sitofp <32 x i32> %qwb to <32 x float>\n"
                 f"  %qb0 = shufflevector <32 x float> %qfb, <32 x float> poison, <16 x i32> <{_lanes(0, 16)}>\n"
                 f"  %qb1 = shufflevector <32 x float> %qfb, <32 x float> poison, <16 x i32> <{_lanes(16, 32)}>\n")
    text += f"  %dpb = getelementptr float, ptr %d0, i64 %b\n  %dbb = load float, ptr %dpb, align 4\n"
    text += _splat(f"dvb", f"%dbb")
    if minimum:
        text += f"  %mpb = getelementptr float, ptr %m0, i64 %b\n  %mbb = load float, ptr %mpb, align 4\n"
        text += _splat(f"mvb", f"%mbb")
    for h in (0, 1):
        text += (f"  %wb{h} = call {VECTOR} {FMA}({VECTOR} %qb{h}, {VECTOR} %dvb, {VECTOR} %mvb)\n"
                 if minimum else f"  %wb{h} = fmul {VECTOR} %qb{h}, %dvb\n")
    text += f"  %xbb = mul i64 %b, 32\n"
    for j in range(rows):
        for h in (0, 1):
            text += (f"  %xp{j}b{h} = getelementptr float, ptr %x{j}, i64 %xbb\n" if h == 0 else
                     f"  %xp{j}b{h} = getelementptr float, ptr %xp{j}b0, i64 16\n")
            text += (f"  %x{j}b{h} = load {VECTOR}, ptr %xp{j}b{h}, align 4\n"
                     f"  %a{j}_s{h}.next = call {VECTOR} {FMA}({VECTOR} %wb{h}, {VECTOR} %x{j}b{h}, "
                     f"{VECTOR} %a{j}_s{h})\n")
    return text


def tile_ir(name: str, kind: str, rows: int) -> str:
    """LLVM IR of @name(x, K, q, d, m, n, N, out, r): out[r + j, n] = x[r + j] . w[n] for `rows` rows j, where
    w's rows are blocks of `kind` (q: [N, K / 32 * bytes], d and m: [N, K / 32] float32). Each row sums into
    two 16-lane sums, added and halved down to one at the end in a fixed order. (Measured: two columns a tile,
    or four sums a row for blocks in pairs, were no faster.)"""
    block, _ = KINDS[kind]
    text = (f"define void @{name}(ptr noalias %x, i64 %K, ptr noalias %q, ptr noalias %d, ptr noalias %m, i64 %n, "
            f"i64 %N, ptr noalias %out, i64 %r) {{\nentry:\n  %blocks = udiv i64 %K, 32\n"
            f"  %row_bytes = mul i64 %blocks, {block}\n  %qo = mul i64 %n, %row_bytes\n"
            f"  %q0 = getelementptr i8, ptr %q, i64 %qo\n  %so = mul i64 %n, %blocks\n"
            f"  %d0 = getelementptr float, ptr %d, i64 %so\n  %m0 = getelementptr float, ptr %m, i64 %so\n")
    for j in range(rows):
        text += (f"  %r{j} = add i64 %r, {j}\n  %xo{j} = mul i64 %r{j}, %K\n"
                 f"  %x{j} = getelementptr float, ptr %x, i64 %xo{j}\n")
    text += "  br label %loop\nloop:\n  %b = phi i64 [ 0, %entry ], [ %b.next, %loop ]\n"
    for j in range(rows):
        for h in (0, 1):
            text += f"  %a{j}_s{h} = phi {VECTOR} [ zeroinitializer, %entry ], [ %a{j}_s{h}.next, %loop ]\n"
    text += _block(kind, rows)
    text += ("  %b.next = add i64 %b, 1\n  %done = icmp eq i64 %b.next, %blocks\n"
             "  br i1 %done, label %end, label %loop\nend:\n")
    for j in range(rows):
        text += _sum(f"s{j}", f"%a{j}_s0.next", f"%a{j}_s1.next")
        text += (f"  %oo{j} = mul i64 %r{j}, %N\n  %oi{j} = add i64 %oo{j}, %n\n"
                 f"  %op{j} = getelementptr float, ptr %out, i64 %oi{j}\n  store float %s{j}, ptr %op{j}, align 4\n")
    return text + "  ret void\n}\n"


def source(kind: str, rows_each=None) -> tuple[str, list[str]]:
    """The IR module of `kind`'s tiles (one per entry of rows_each, by default this CPU's ROWS) and their names."""
    rows_each = ROWS if rows_each is None else rows_each
    names = [f"{kind.lower()}_{rows}" for rows in rows_each]
    return FMA_DECLARATION + "".join(
        tile_ir(name, kind, rows) for name, rows in zip(names, rows_each)), names


@functools.cache
def tiles(kind: str) -> np.ndarray:
    """The addresses of `kind`'s tiles (one per entry of ROWS), compiled for this CPU."""
    return compile_ir(*source(kind), "float block tiles")


@numba.njit(fastmath=True, cache=True, boundscheck=False)
def normed(x, norm, eps):
    """x's rows RMS-normalised and times `norm` (when norm has entries; else a contiguous copy of x)."""
    rows, size = x.shape
    out = np.empty((rows, size), dtype=np.float32)
    for r in range(rows):
        scale = np.float32(1.0)
        if norm.shape[0]:
            total = np.float32(0.0)
            for i in range(size):
                total += x[r, i] * x[r, i]
            scale = np.float32(1.0) / np.sqrt(total / np.float32(size) + eps)
        for i in range(size):
            out[r, i] = x[r, i] * scale * (norm[i] if norm.shape[0] else np.float32(1.0))
    return out


@numba.njit(parallel=True, cache=True, boundscheck=False)
def linear(x, norm, eps, weight):
    """rms_norm(x) (when norm has entries, else x) times the transposed block weight (q, d, m, tiles): [rows, N]."""
    q, d, m, tile = weight
    xn = normed(x, norm, eps)
    rows, size = xn.shape
    outputs = q.shape[0]
    out = np.empty((rows, outputs), dtype=np.float32)
    for chunk in prange((outputs + CHUNK - 1) // CHUNK):
        # the addresses are taken here, in the loop: taken before it, numba may free xn once they are read
        X, Q, D, M, O = xn.ctypes.data, q.ctypes.data, d.ctypes.data, m.ctypes.data, out.ctypes.data
        r = 0
        while r < rows:
            t = 0
            while ROWS[t] > rows - r:  # the most rows that fit: they share each unpacked block
                t += 1
            for n in range(chunk * CHUNK, min(outputs, chunk * CHUNK + CHUNK)):
                call(tile[t], X, size, Q, D, M, n, outputs, O, r)
            r += ROWS[t]
    return out


class Blocks:
    """One GGUF tensor's blocks, row by row: q [N, K / 32 * bytes] (uint8), d and m [N, K / 32] (float32)."""

    def __init__(self, kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray):
        self.kind, self.q, self.d, self.m = kind, q, d, m

    @classmethod
    def read(cls, tensor) -> "Blocks":
        kind = tensor.tensor_type.name
        if kind not in KINDS:
            raise CodespecError(f"--weights gguf reads Q4_1 and Q8_0 blocks; {tensor.name} is {kind}")
        block, minimum = KINDS[kind]
        raw = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1, block + (4 if minimum else 2))
        d = raw[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        m = (raw[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32) if minimum
             else np.zeros_like(d))
        q = np.ascontiguousarray(raw[:, :, 4 if minimum else 2 :]).reshape(raw.shape[0], -1)
        return cls(kind, q, d, m)

    def nbytes(self, q8: bool = False) -> int:
        """What the kernel reads of these blocks: the float tiles' float32 scales (and Q4_1's minimums), or q8's
        float16 scale and minimum."""
        if q8:
            return self.q.nbytes + self.d.size * 4
        return self.q.nbytes + self.d.nbytes + (self.m.nbytes if KINDS[self.kind][1] else 0)

    def rows(self, index) -> "Blocks":
        return Blocks(self.kind, self.q[index], self.d[index], self.m[index])

    def scaled(self, scale: float) -> "Blocks":
        """The same blocks times `scale` (a power of two keeps every weight exact)."""
        return Blocks(self.kind, self.q, (self.d.astype(np.float64) * scale).astype(np.float32),
                      (self.m.astype(np.float64) * scale).astype(np.float32))

    @staticmethod
    def cat(parts: list["Blocks"]) -> "Blocks":
        if len({p.kind for p in parts}) != 1:
            raise CodespecError("--weights gguf: the projections fused into one (q/k/v, gate/up) mix Q4_1 and Q8_0")
        return Blocks(parts[0].kind, *(np.concatenate([getattr(p, a) for p in parts]) for a in "qdm"))

    def values(self) -> torch.Tensor:
        """The weights [N, K] in float32, each q * d + m rounded once as the kernel's fused multiply-add rounds it:
        q * d is exact in float32 (a float16 scale times at most 8 bits), so adding m is the only rounding."""
        n, blocks = self.d.shape
        if KINDS[self.kind][1]:
            q = np.concatenate([self.q.reshape(n, blocks, 16) & 15, self.q.reshape(n, blocks, 16) >> 4], axis=2)
        else:
            q = self.q.view(np.int8).reshape(n, blocks, 32)
        w = q.astype(np.float32) * self.d[:, :, None]
        w += self.m[:, :, None]
        return torch.from_numpy(w.reshape(n, blocks * 32))

    def weight(self, q8: bool = False) -> tuple:
        """What `linear` takes, or with q8 what q8_tiles.linear takes."""
        if q8:
            from . import q8_tiles
            return q8_tiles.repack(self.kind, self.q, self.d, self.m)
        return (self.q, self.d, self.m, tiles(self.kind))


def _reader(path: Path):
    """gguf's GGUFReader, skipping over the contents of arrays (the tokenizer's vocabulary, merges, scores and token
    types, of no use here): reading them took 4 of the 5 seconds a load spent in this module, and the numeric ones
    another ~1 s. The last file read is kept,
    so that --weights auto's check and read_gguf parse it once (0.75 s)."""
    stat = Path(path).stat()
    return _read(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read(path: str, size: int, modified: int):
    import gguf

    class TensorsOnly(gguf.GGUFReader):
        def _get_field_parts(self, offs, raw_type):
            if raw_type == gguf.GGUFValueType.ARRAY and self.byte_order != "S":
                item_type, count = int(self._get(offs, np.uint32)[0]), int(self._get(offs + 4, np.uint64)[0])
                if item_type == gguf.GGUFValueType.STRING:
                    raw, end = memoryview(self.data), offs + 12
                    for _ in range(count):  # each string: its length (uint64), then its bytes
                        end += 8 + int.from_bytes(raw[end : end + 8], "little")
                    return end - offs, [], [], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
                scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(item_type))
                if scalar is not None:  # numbers (the tokens' scores and types): skipped whole, not one by one
                    size = 12 + count * np.dtype(scalar).itemsize
                    return size, [], [], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(item_type)]
            return super()._get_field_parts(offs, raw_type)

    return TensorsOnly(path)


def unreadable(path: Path) -> str | None:
    """Why read_gguf cannot take `path`'s projections (a tensor in another format, a file it cannot parse), or
    None: what --weights auto asks before it picks the blocks."""
    try:
        tensors = _reader(path).tensors
    except Exception as exc:  # gguf raises ValueError and others for a file it cannot parse
        return f"cannot read {path}: {exc}"
    return _unsupported(tensors)


def _unsupported(tensors) -> str | None:
    for tensor in tensors:
        if tensor.name.endswith(".weight") and len(tensor.shape) == 2 and tensor.tensor_type.name not in KINDS:
            return f"{tensor.name} is {tensor.tensor_type.name}"
    return None


def read_gguf(path: Path, model, order: torch.Tensor, scale: float) -> dict:
    """Read the Q4_1 / Q8_0 blocks of `path` (the GGUF `model` was converted from), overwrite the model's float32
    weights with their values, and return the blocks the lean forward needs, its rows in its own order (q and
    k heads with rows reordered by `order`, q's times `scale`): {"layers": [qkv, o, gate_up, down] per layer,
    "head": the output layer}."""
    try:
        reader = _reader(path)
    except Exception as exc:  # gguf raises ValueError and others for a file it cannot parse
        raise CodespecError(f"--weights gguf: cannot read {path}: {exc}") from None
    if problem := _unsupported(reader.tensors):  # before any weight is overwritten
        raise CodespecError(f"--weights gguf reads Q4_1 and Q8_0 blocks; {problem}")
    tensors = {t.name: t for t in reader.tensors}
    config, inner = model.config, model.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    back = torch.argsort(order)  # lean row i of a head is the model's row order[i]

    def blocks(name: str) -> Blocks:
        if name not in tensors:
            raise CodespecError(f"--weights gguf: {path.name} has no tensor {name}")
        return Blocks.read(tensors[name])

    def load(parameter: torch.Tensor, values: torch.Tensor, name: str) -> None:
        if tuple(values.shape) != tuple(parameter.shape):
            raise CodespecError(f"--weights gguf: {name} is {tuple(values.shape)}, "
                                f"the model's {tuple(parameter.shape)}")
        parameter.data.copy_(values)

    def heads_part(name: str, parameter: torch.Tensor, count: int) -> Blocks:
        """q or k: llama.cpp stores Llama's rotated pairs side by side (the lean order), other models as the
        model has them; whichever the file's values match is taken."""
        found = blocks(name)
        values = found.values()
        lean_as_model = values.view(count, head_dim, -1)[:, back].reshape(values.shape)
        lean_rows = torch.arange(values.shape[0]).view(count, head_dim)[:, order].reshape(-1)
        if (lean_as_model - parameter).abs().max() <= (values - parameter).abs().max():  # the file's rows: lean
            load(parameter, lean_as_model, name)
            return found
        load(parameter, values, name)
        return found.rows(lean_rows.numpy())

    layers = []
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q = heads_part(f"blk.{i}.attn_q.weight", attn.q_proj.weight, heads).scaled(scale)
        k = heads_part(f"blk.{i}.attn_k.weight", attn.k_proj.weight, kv_heads)
        parts = {}
        for key, name, parameter in (("v", "attn_v", attn.v_proj.weight), ("o", "attn_output", attn.o_proj.weight),
                                     ("gate", "ffn_gate", mlp.gate_proj.weight), ("up", "ffn_up", mlp.up_proj.weight),
                                     ("down", "ffn_down", mlp.down_proj.weight)):
            parts[key] = blocks(f"blk.{i}.{name}.weight")
            load(parameter, parts[key].values(), f"blk.{i}.{name}.weight")
        layers.append([Blocks.cat([q, k, parts["v"]]), parts["o"], Blocks.cat([parts["gate"], parts["up"]]),
                       parts["down"]])
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    head = blocks(head_name)
    load(model.lm_head.weight, head.values(), head_name)
    if head_name == "output.weight":  # untied: the embedding table has its own blocks
        load(inner.embed_tokens.weight, blocks("token_embd.weight").values(), "token_embd.weight")
    return {"layers": layers, "head": head}
