"""Activations rounded to 8 bits, times a GGUF's blocks in exact integers (`--activations q8`).

llama.cpp multiplies its Q4_1 and Q8_0 weights this way on CPUs: each row's inputs to a projection are rounded per
block of 32 to 8-bit integers with one float scale (its Q8_1), and a block's dot product is formed in integers.
Here:

- **Rounding** (`rounded8`): per row and block of 32, xq = rint(x * 127 / a) with a the block's largest magnitude,
  xd = a / 127 and xs = xd * sum(xq).
- **Sixteen output columns at a time.** The weights are repacked when the model loads so that one 64-byte vector
  holds four consecutive weights of each of 16 columns (for Q4_1 two such steps, as the low and high nibbles).
  One VNNI instruction (vpdpbusd) then multiplies them by four of a row's 8-bit inputs, broadcast, and adds the
  products into 16 integer sums, one per column: 64 products an instruction, no unpacking to floats and no
  horizontal sums. Per block of 32 inputs and per row, the 16 integer sums become floats once:
  out += float(sum) * (d * xd) then out += m * xs (Q4_1's w = q * d + m; Q8_0's signed q are stored plus 128,
  with m = -128 d, so both kinds are one kernel).
- **Exact and batch-invariant.** Integer sums are exact in any order, and each (row, column) then goes through the
  same float operations in the same order whichever rows share the tile (one to eight): a row's projections do not
  depend on the other rows of its forward (`tests/unit/test_q8.py`).
- d and m stay float16, as the file has them (20 bytes a Q4_1 block, against the float tiles' 24).

The rounding changes the numbers the model multiplies (as it does in llama.cpp), so the text may differ from
`--activations float32`'s; speculative and plain decoding multiply the same numbers, so their texts are identical.
"""

from __future__ import annotations

import dataclasses
import functools

import numba
import numpy as np
from numba import prange

from . import capabilities
from .ir import FMA_DECLARATION, constant, lanes, splat
from .native import call, compile_ir

COLUMNS = 16  # output columns a tile computes (one 16-lane vector)
STEP_BYTES = 64  # one step: four weights of each of 16 columns
CHUNK_BYTES = 24 * 1024  # a thread takes as many column groups as fit in this much L1 at a time


@dataclasses.dataclass(frozen=True)
class Form:
    """How `repack` holds a tensor's blocks: 4-bit nibbles (0..15) or bytes (signed values stored plus 128); one
    scale a block of 32 or two (one per 16 weights); a minimum (w = q d + m) or none; scales as float16 (the
    file's own, where they are float16 values) or float32 (wide: K-quants' sub-block scales, d times a 6-bit
    integer); with `planes` 1 or 2, five- or six-bit weights (0..31: Q5_0 plus 16, Q5_1, Q5_K; 0..63: Q6_K plus
    32) as their low nibbles and planes of their higher bits (the VNNI and AVX2 tiles'). Per block and column
    group: `steps` 64-byte steps (and 64 bytes a plane, laid out as `_steps` says for the instruction set),
    then `slots` vectors of 16 scales (the d's, then the m's; with `offset` the m's are not held but formed in the
    tile, m = -offset d: the same float32 values, exactly, as Q4_0's -8 d, Q5_0's -16 d, Q6_K's -32 d and the VNNI
    tiles' -128 d for bytes). `factored`: the scales as the K-quant file holds them, a signed byte each times its
    super-block's float32 base (per 8 blocks and column: one vector for the d's, one for the m's), formed in the
    tile (exact: a float16 value times a byte fits float32's 24 bits, the same values as `wide` holds)."""
    nibbles: bool
    scales: int = 1
    minimum: bool = True
    wide: bool = False
    planes: int = 0
    offset: int = 0
    factored: bool = False

    @property
    def name(self) -> str:
        scalars = "f" if self.factored else "w" if self.wide else "h"
        return (f"{'n' if self.nibbles else 'b'}{self.scales}{'m' if self.minimum else ''}{scalars}"
                f"{f'p{self.planes}' if self.planes else ''}{f'o{self.offset}' if self.offset else ''}")

    @property
    def steps(self) -> int:
        return 4 if self.nibbles else 8

    @property
    def block_bytes(self) -> int:
        return (self.steps + self.planes) * STEP_BYTES

    @property
    def slots(self) -> int:
        return self.scales * (2 if self.minimum and not self.offset else 1)


ARGUMENTS = ("ptr noalias %x, i64 %K, ptr noalias %q, ptr noalias %s, i64 %g, ptr noalias %out, i64 %N, i64 %r, "
             "ptr noalias %xd, ptr noalias %xs, ptr noalias %xh")


def tile_ir(name: str, form: Form, rows: int, isa: str = "vnni") -> str:
    """LLVM IR of @name(x, K, q, s, g, out, N, r, xd, xs, xh): out[r + j, 16 g .. 16 g + 15] for `rows` rows j of
    rounded inputs x [rows, K] (int8; xd, xs [rows, K / 32], xh [rows, K / 16]: rounded8) and column group g's
    repacked blocks (q: form.steps 64-byte steps per block, s: form.slots vectors of 16 scales per block), with the
    integer sums of ISAS[isa]. On AVX2 the group's two halves (columns 0-7, 8-15) each run the blocks in a loop of
    their own (`_loop`): its 16 registers hold four rows' float sums and 16-bit sums of one half, where both
    halves' spilled to the stack every block (the four-row Q4_1 tile: 108 of its 448 instructions)."""
    if isa not in EVERY_ROW or rows == 1:  # (one row: 5 spills in one loop, and the halves would read its inputs twice)
        return _loop(name, "", form, rows, isa, None)
    values = ARGUMENTS.replace("ptr noalias", "ptr")
    return (_loop(f"{name}.h0", "internal ", form, rows, isa, 0) + _loop(f"{name}.h1", "internal ", form, rows, isa, 1)
            + f"define void @{name}({ARGUMENTS}) {{\nentry:\n  call void @{name}.h0({values})\n"
            f"  call void @{name}.h1({values})\n  ret void\n}}\n")


def _loop(name: str, linkage: str, form: Form, rows: int, isa: str, half: int | None) -> str:
    """tile_ir's function @name, over all 16 columns (half None) or over half `half` of them (8 lanes: AVX2)."""
    count = 16 if half is None else 8  # lanes of the float sums
    first = 0 if half is None else 8 * half  # their first column in the group
    floats = f"<{count} x float>"
    fma = f"@llvm.fma.v{count}f32"
    scalar = "float" if form.wide else "half"
    block_bytes = form.block_bytes
    text = (f"define {linkage}void @{name}({ARGUMENTS}) {{\nentry:\n"
            f"  %blocks = udiv i64 %K, 32\n  %gb = mul i64 %g, %blocks\n")
    for j in range(rows):
        text += (f"  %r{j} = add i64 %r, {j}\n  %xo{j} = mul i64 %r{j}, %K\n"
                 f"  %x{j} = getelementptr i8, ptr %x, i64 %xo{j}\n  %bo{j} = mul i64 %r{j}, %blocks\n"
                 f"  %xd{j} = getelementptr float, ptr %xd, i64 %bo{j}\n"
                 f"  %xs{j} = getelementptr float, ptr %xs, i64 %bo{j}\n  %ho{j} = mul i64 %bo{j}, 2\n"
                 f"  %xh{j} = getelementptr float, ptr %xh, i64 %ho{j}\n")
    text += "  br label %loop\nloop:\n  %b = phi i64 [ 0, %entry ], [ %b.next, %loop ]\n"
    for j in range(rows):
        text += f"  %a{j} = phi {floats} [ zeroinitializer, %entry ], [ %a{j}.next, %loop ]\n"
    text += (f"  %gbb = add i64 %gb, %b\n  %qo = mul i64 %gbb, {block_bytes}\n"
             f"  %qp = getelementptr i8, ptr %q, i64 %qo\n")
    weights = []  # (step, vector name) for the block's 8 steps of 4 weights (on AVX2 the half's 32 bytes of each)
    size, at = (64, 0) if half is None else (32, 32 * half)  # the bytes of each step read here
    for p in range(form.steps):
        text += (f"  %qp{p} = getelementptr i8, ptr %qp, i64 {p * STEP_BYTES + at}\n"
                 f"  %qv{p} = load <{size} x i8>, ptr %qp{p}, align 1\n")
        if form.nibbles:  # step p in the low nibbles, step p + 4 in the high ones
            text += (f"  %w{p} = and <{size} x i8> %qv{p}, splat (i8 15)\n"
                     f"  %w{p + 4} = lshr <{size} x i8> %qv{p}, splat (i8 4)\n")
            weights += [(p, f"%w{p}"), (p + 4, f"%w{p + 4}")]
        else:
            weights.append((p, f"%qv{p}"))
    weights = sorted(weights)
    for plane in range(form.planes if isa == "vnni" else 0):  # each step's bit 4 + plane, 64 of them, as a mask
        # (AVX-512BW's byte masks; AVX2 has none: _avx2_half shifts its planes' bits into place instead)
        text += (f"  %fp{plane} = getelementptr i8, ptr %qp, i64 {(form.steps + plane) * STEP_BYTES}\n"
                 f"  %fv{plane} = load <8 x i64>, ptr %fp{plane}, align 1\n")
        for step, vector in weights:
            name = f"%f{plane}_{step}"
            text += (f"  {name}.b = extractelement <8 x i64> %fv{plane}, i64 {step}\n"
                     f"  {name}.m = bitcast i64 {name}.b to <64 x i1>\n"
                     f"  {name}.s = select <64 x i1> {name}.m, <64 x i8> splat (i8 {16 << plane}), <64 x i8> "
                     f"zeroinitializer\n  {name} = or <64 x i8> {vector}, {name}.s\n")
        weights = [(step, f"%f{plane}_{step}") for step, _ in weights]
    if form.factored:  # a group: its blocks' bytes [block, slot, column], then its bases [block / 8, kind, column]
        kinds = 1 + (form.slots > form.scales)
        text += (f"  %sgs = mul i64 %blocks, {16 * form.slots + 8 * kinds}\n  %sg = mul i64 %g, %sgs\n"
                 f"  %sbo = mul i64 %b, {16 * form.slots}\n  %so = add i64 %sg, %sbo\n"
                 f"  %sp = getelementptr i8, ptr %s, i64 %so\n  %sbs = mul i64 %blocks, {16 * form.slots}\n"
                 f"  %sb8 = lshr i64 %b, 3\n  %sbk = mul i64 %sb8, {64 * kinds}\n  %sba = add i64 %sbs, %sbk\n"
                 f"  %sbb = add i64 %sg, %sba\n  %basep = getelementptr i8, ptr %s, i64 %sbb\n")
        for kind in range(kinds):
            text += (f"  %base{kind}.p = getelementptr float, ptr %basep, i64 {16 * kind + first}\n"
                     f"  %base{kind} = load {floats}, ptr %base{kind}.p, align 4\n")
    else:
        text += f"  %so = mul i64 %gbb, {16 * form.slots}\n  %sp = getelementptr {scalar}, ptr %s, i64 %so\n"
    slots = [f"%d{i}" for i in range(form.scales)] + [f"%m{i}" for i in range(form.scales if form.minimum else 0)]
    for i, slot in enumerate(slots):
        if i >= form.scales and form.offset:  # m = -offset d, exact
            text += f"  {slot} = fmul {floats} %d{i - form.scales}, splat (float {-form.offset:.1f})\n"
            continue
        if form.factored:  # the byte times its super-block's base
            text += (f"  {slot}.p = getelementptr i8, ptr %sp, i64 {16 * i + first}\n"
                     f"  {slot}.b = load <{count} x i8>, ptr {slot}.p, align 1\n"
                     f"  {slot}.f = sitofp <{count} x i8> {slot}.b to {floats}\n"
                     f"  {slot} = fmul {floats} {slot}.f, %base{int(i >= form.scales)}\n")
            continue
        text += (f"  {slot}.p = getelementptr {scalar}, ptr %sp, i64 {16 * i + first}\n"
                 f"  {slot}{'' if form.wide else '.h'} = load <{count} x {scalar}>, ptr {slot}.p, align 2\n")
        if not form.wide:
            text += f"  {slot} = fpext <{count} x half> {slot}.h to {floats}\n"
    text += "  %xb = mul i64 %b, 32\n  %hb = mul i64 %b, 2\n"
    if isa in SHARED:
        text += SHARED[isa](form, weights)
    if isa in EVERY_ROW and half is not None:
        text += EVERY_ROW[isa](form, weights, rows, half)
    elif isa in EVERY_ROW:  # both halves in this loop, each step's halves taken from its 64 bytes
        for h in (0, 1):
            halves = []
            for step, vector in weights:
                text += (f"  {vector}.{h} = shufflevector <64 x i8> {vector}, <64 x i8> poison, "
                         f"<32 x i32> <{lanes(range(32 * h, 32 * h + 32))}>\n")
                halves.append((step, f"{vector}.{h}"))
            text += EVERY_ROW[isa](form, halves, rows, h, inputs=h == 0, named=f"%ci{{j}}_{{part}}.{h}")
        for j in range(rows):
            for part in range(form.scales):
                text += (f"  %ci{j}_{part} = shufflevector <8 x i32> %ci{j}_{part}.0, <8 x i32> %ci{j}_{part}.1, "
                         f"<16 x i32> <{lanes(range(16))}>\n")
    for j in range(rows):
        # %ci{j}_{part}: the columns' integer sums over the block (part 0), or over each half (parts 0, 1)
        text += SUMS[isa](form, weights, j, rows) if isa in SUMS else ""
        text += f"  %xdp{j} = getelementptr float, ptr %xd{j}, i64 %b\n" + splat(f"xdv{j}", f"%xdp{j}", floats,
                                                                                    "float", count)
        terms = []  # (x, y) of each x * y added to the row's sums, in order
        for part in range(form.scales):  # out += float(sum) * (d * xd), per scale
            text += (f"  %cf{j}_{part} = sitofp <{count} x i32> %ci{j}_{part} to {floats}\n"
                     f"  %sc{j}_{part} = fmul {floats} %d{part}, %xdv{j}\n")
            terms.append((f"%cf{j}_{part}", f"%sc{j}_{part}"))
        for part in range(form.scales if form.minimum else 0):  # out += m * xd * sum(xq), per scale
            if form.scales == 1:
                text += f"  %xsp{j} = getelementptr float, ptr %xs{j}, i64 %b\n"
                text += splat(f"xsv{j}_{part}", f"%xsp{j}", floats, "float", count)
            else:
                text += (f"  %xho{j}_{part} = add i64 %hb, {part}\n"
                         f"  %xhp{j}_{part} = getelementptr float, ptr %xh{j}, i64 %xho{j}_{part}\n")
                text += splat(f"xsv{j}_{part}", f"%xhp{j}_{part}", floats, "float", count)
            terms.append((f"%m{part}", f"%xsv{j}_{part}"))
        total = f"%a{j}"
        for i, (x, y) in enumerate(terms):  # one fused multiply-add each; the last is the sums the loop carries
            name = f"%a{j}.next" if i == len(terms) - 1 else f"%t{j}_{i}"
            text += f"  {name} = call {floats} {fma}({floats} {x}, {floats} {y}, {floats} {total})\n"
            total = name
    text += ("  %b.next = add i64 %b, 1\n  %done = icmp eq i64 %b.next, %blocks\n"
             f"  br i1 %done, label %end, label %loop\nend:\n  %col = mul i64 %g, 16\n  %colh = add i64 %col, {first}\n")
    for j in range(rows):
        text += (f"  %oo{j} = mul i64 %r{j}, %N\n  %oi{j} = add i64 %oo{j}, %colh\n"
                 f"  %op{j} = getelementptr float, ptr %out, i64 %oi{j}\n"
                 f"  store {floats} %a{j}.next, ptr %op{j}, align 4\n")
    return text + "  ret void\n}\n"


def _row_inputs(j: int, step: int, lanes: int) -> str:
    """%xv{j}_{step}: row j's four inputs of `step` (4 bytes) in every 32-bit lane of `lanes` lanes."""
    text = (f"  %xo{j}_{step} = add i64 %xb, {4 * step}\n"
            f"  %xp{j}_{step} = getelementptr i8, ptr %x{j}, i64 %xo{j}_{step}\n")
    text += splat(f"xi{j}_{step}", f"%xp{j}_{step}", f"<{lanes} x i32>", "i32", lanes)
    return text + f"  %xv{j}_{step} = bitcast <{lanes} x i32> %xi{j}_{step} to <{lanes * 4} x i8>\n"


def _vnni_sums(form: Form, weights: list, j: int, rows: int) -> str:
    """%ci{j}_{part}: row j's 16 integer sums for the block, one vpdpbusd per step (64 products: the stored bytes,
    unsigned, times the signed inputs) in two independent chains, steps 0-3 (weights 0-15) and 4-7 (16-31): added
    for a form of one scale (exact in any order), each its own part for a form of two."""
    chains = {0: "zeroinitializer", 1: "zeroinitializer"}
    last = {step // 4: step for step, _ in weights}  # (weights are in step order)
    text = ""
    for step, vector in weights:
        chain = step // 4
        name = f"%ci{j}_{chain}" if form.scales == 2 and step == last[chain] else f"%c{j}_{step}"
        text += _row_inputs(j, step, 16)
        text += (f"  {name} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {chains[chain]}, "
                 f"<64 x i8> {vector}, <64 x i8> %xv{j}_{step})\n")
        chains[chain] = name
    if form.scales == 2:
        return text
    return text + f"  %ci{j}_0 = add <16 x i32> {chains[0]}, {chains[1]}\n"


def _avx2_half(form: Form, step: int, vector: str, half: int, loaded: set) -> tuple[str, str]:
    """(IR, name) of half `half` (columns 0-7, 8-15) of a step as unsigned bytes, from `vector`, the step's 32 bytes
    of that half; for bytes also the signed weights {name}.s (the stored bytes less 128) and their magnitudes
    {name}.a. With planes (five- and six-bit weights: `_lay_steps`, shifted), the half's higher bits are a field of
    the bytes of one 32-byte plane vector (loaded once a block: `loaded`), shifted into bits 4.. and added to its
    nibbles: a shift, an and, an or."""
    name, fields, text = f"%h{step}_{half}", 8 // max(1, form.planes), ""
    if form.planes:
        plane = 2 * (step // fields) + half
        if plane not in loaded:
            loaded.add(plane)
            text += (f"  %pp{plane} = getelementptr i8, ptr %qp, i64 {form.steps * STEP_BYTES + 32 * plane}\n"
                     f"  %pv{plane} = load <32 x i8>, ptr %pp{plane}, align 1\n")
        shift, moved = 4 - form.planes * (step % fields), f"%pv{plane}"
        if shift:
            moved = f"{name}.t"
            text += f"  {moved} = {'shl' if shift > 0 else 'lshr'} <32 x i8> %pv{plane}, splat (i8 {abs(shift)})\n"
        text += (f"  {name}.p = and <32 x i8> {moved}, splat (i8 {((1 << form.planes) - 1) << 4})\n"
                 f"  {name} = or <32 x i8> {vector}, {name}.p\n")
        vector = name
    if not form.nibbles:
        text += (f"  {vector}.s = xor <32 x i8> {vector}, splat (i8 -128)\n"
                 f"  {vector}.a = call <32 x i8> @llvm.abs.v32i8(<32 x i8> {vector}.s, i1 false)\n")
    return text, vector


def _avx2_sums(form: Form, weights: list, rows: int, half: int, inputs: bool = True,
                named: str = "%ci{j}_{part}") -> str:
    """%ci{j}_{part}: each row j's 8 integer sums of half `half` (`weights`: that half's 32 bytes of each step) in
    AVX2's vpmaddubsw (unsigned bytes times signed bytes, pairs added into 16-bit lanes, saturating) and vpmaddwd
    (16-bit pairs added into 32 bits), a step at a time for every row, each step's half formed just before the rows
    use it. No sum saturates, so each is exact:
    - nibbles (0..15 times |x| <= 127): a pair is at most 3,810 and a block's 16 products per lane 30,480, so the
      16-bit sums of all 8 steps are added before one vpmaddwd per half; with planes, five bits (0..31: a pair at
      most 7,874) four steps at a time, six bits (0..63: 16,002) two;
    - bytes (signed, down to -128: a pair of 128 x 127 is 32,512): the weights' magnitudes times the inputs with the
      weights' signs (vpsignb: llama.cpp's way), widened every step, summed per part (per 16 weights for forms
      of two scales).
    `inputs`: form each row's inputs of a step here (else the other half's sums, in the same loop, did); `named`:
    the sums' names."""
    text, loaded = "", set()
    run = {0: 8, 1: 4, 2: 2}[form.planes]  # steps whose 16-bit sums are added before they are widened
    wide, short = {}, {}  # (row, part) -> its 32-bit sums; nibbles: (16-bit sums, steps in them)

    def widen(key):  # a row's part's 16-bit sums into 32 bits, added to what it has there
        name, _ = short.pop(key)
        text = f"  {name}.w = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {name}, <16 x i16> splat (i16 1))\n"
        if key in wide:
            text += f"  {name}.ws = add <8 x i32> {wide[key]}, {name}.w\n"
        wide[key] = f"{name}.ws" if key in wide else f"{name}.w"
        return text

    for step, vector in weights:
        formed, h = _avx2_half(form, step, vector, half, loaded)
        text += formed
        part = step * form.scales // 8
        for j in range(rows):
            text += _row_inputs(j, step, 8) if inputs else ""
            name, key = f"%p{j}_{step}_{half}", (j, part)
            if form.nibbles:
                text += f"  {name} = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {h}, <32 x i8> %xv{j}_{step})\n"
                if key in short and short[key][1] == run:
                    text += widen(key)
                if key in short:
                    text += f"  {name}.sum = add <16 x i16> {short[key][0]}, {name}\n"
                    short[key] = (f"{name}.sum", short[key][1] + 1)
                else:
                    short[key] = (name, 1)
                continue
            text += (f"  {name}.x = call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> %xv{j}_{step}, <32 x i8> {h}.s)\n"
                     f"  {name}.m = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {h}.a, <32 x i8> {name}.x)\n"
                     f"  {name} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {name}.m, <16 x i16> splat (i16 1))\n")
            if key in wide:
                text += f"  {name}.sum = add <8 x i32> {wide[key]}, {name}\n"
                name += ".sum"
            wide[key] = name
    for key in list(short):
        text += widen(key)
    for (j, part), name in wide.items():
        text += f"  {named.format(j=j, part=part)} = add <8 x i32> {name}, zeroinitializer\n"  # (a name: folded)
    return text


def _neon_weights(form: Form, weights: list) -> str:
    """Each step's 64 bytes as four 16-byte quarters %n{step}_{k} (columns 4k..4k + 3), shared by the rows; for
    bytes the signed weights (the stored bytes less 128): sdot multiplies signed bytes by signed bytes."""
    text = ""
    for step, vector in weights:
        if not form.nibbles:
            text += f"  %n{step}.s = xor <64 x i8> {vector}, splat (i8 -128)\n"
            vector = f"%n{step}.s"
        for k in range(4):
            text += (f"  %n{step}_{k} = shufflevector <64 x i8> {vector}, <64 x i8> poison, "
                     f"<16 x i32> <{lanes(range(16 * k, 16 * k + 16))}>\n")
    return text


def _neon_sums(form: Form, weights: list, j: int, rows: int) -> str:
    """%ci{j}_{part}: row j's 16 integer sums in ARM64's sdot (16 signed bytes times 16, each four adjacent products
    added into one of four 32-bit lanes: a quarter's four columns), one per quarter and step, in the VNNI tiles'
    two chains (steps 0-3, 4-7): added for a form of one scale, each its own part for two. A product is at most
    128 x 127 and a lane takes 32 a block: exact."""
    chains = {(chain, k): "zeroinitializer" for chain in (0, 1) for k in range(4)}
    text = ""
    for step, _ in weights:
        text += _row_inputs(j, step, 4)
        for k in range(4):
            name = f"%c{j}_{step}_{k}"
            text += (f"  {name} = call <4 x i32> @llvm.aarch64.neon.sdot.v4i32.v16i8(<4 x i32> {chains[step // 4, k]}, "
                     f"<16 x i8> %n{step}_{k}, <16 x i8> %xv{j}_{step})\n")
            chains[step // 4, k] = name
    added, parts = _parts(form, chains, 4, f"%c{j}")
    text += added
    for part, (a, b, c, d) in parts.items():  # four quarters into the 16 columns, in order
        text += (f"  %ci{j}_{part}.l = shufflevector <4 x i32> {a}, <4 x i32> {b}, <8 x i32> <{lanes(range(8))}>\n"
                 f"  %ci{j}_{part}.h = shufflevector <4 x i32> {c}, <4 x i32> {d}, <8 x i32> <{lanes(range(8))}>\n"
                 f"  %ci{j}_{part} = shufflevector <8 x i32> %ci{j}_{part}.l, <8 x i32> %ci{j}_{part}.h, "
                 f"<16 x i32> <{lanes(range(16))}>\n")
    return text


def _parts(form: Form, chains: dict, count: int, name: str) -> tuple[str, dict]:
    """The two chains' `count` vectors of <4 x i32> sums (steps 0-3, 4-7: chains[chain, k]) as the tile's parts:
    added into one (a form of one scale: `name`_k) or each its own (two scales). (IR text, {part: vectors})."""
    if form.scales == 2:
        return "", {part: [chains[part, k] for k in range(count)] for part in (0, 1)}
    text = "".join(f"  {name}_{k} = add <4 x i32> {chains[0, k]}, {chains[1, k]}\n" for k in range(count))
    return text, {0: [f"{name}_{k}" for k in range(count)]}


def _i8mm_weights(form: Form, weights: list) -> str:
    """Per pair of steps (p, p + 1: weights 4p..4p + 7) and pair of columns (2c, 2c + 1), the 16 bytes smmla takes
    as its second matrix %mm{p}_{c}: column 2c's eight weights, then column 2c + 1's (signed: bytes less 128), shared
    by the rows."""
    text, steps = "", dict(weights)
    for step, vector in weights:
        if not form.nibbles:
            text += f"  %mb{step}.s = xor <64 x i8> {vector}, splat (i8 -128)\n"
            steps[step] = f"%mb{step}.s"
    for p in range(0, 8, 2):
        for c in range(8):
            first, second = range(8 * c, 8 * c + 4), range(8 * c + 4, 8 * c + 8)  # columns 2c and 2c + 1 in a step
            order = [*first, *(64 + i for i in first), *second, *(64 + i for i in second)]
            text += (f"  %mm{p}_{c} = shufflevector <64 x i8> {steps[p]}, <64 x i8> {steps[p + 1]}, "
                     f"<16 x i32> <{lanes(order)}>\n")
    return text


def _i8mm_sums(form: Form, weights: list, j: int, rows: int) -> str:
    """%ci{j}_{part} and %ci{j + 1}_{part}: two rows' 16 integer sums at once in ARM64's smmla (a 2 x 8 matrix of
    signed bytes times an 8 x 2 one into a 2 x 2 of 32-bit sums: rows j and j + 1 against columns 2c and 2c + 1), one
    per pair of columns and pair of steps: half sdot's instructions. A row with no partner (the last of an odd
    count) is paired with itself and the copy dropped. Exact, as sdot's: 16 products of at most 128 x 127 a lane."""
    if j % 2:
        return ""  # (row j - 1's pair made them)
    other = j + 1 if j + 1 < rows else j
    text = ""
    for p in range(0, 8, 2):  # the two rows' eight inputs of steps p and p + 1, side by side
        for row in dict.fromkeys((j, other)):
            text += (f"  %yo{row}_{p} = add i64 %xb, {4 * p}\n  %yp{row}_{p} = getelementptr i8, ptr %x{row}, "
                     f"i64 %yo{row}_{p}\n  %yv{row}_{p} = load <8 x i8>, ptr %yp{row}_{p}, align 1\n")
        text += (f"  %yy{j}_{p} = shufflevector <8 x i8> %yv{j}_{p}, <8 x i8> %yv{other}_{p}, "
                 f"<16 x i32> <{lanes(range(16))}>\n")
    chains = {}
    for chain in (0, 1):  # steps 0-3 (weights 0-15) and 4-7 (16-31): each a scale's part, or added
        for c in range(8):
            total = "zeroinitializer"
            for p in (4 * chain, 4 * chain + 2):
                name = f"%mmc{j}_{p}_{c}"
                text += (f"  {name} = call <4 x i32> @llvm.aarch64.neon.smmla.v4i32.v16i8(<4 x i32> {total}, "
                         f"<16 x i8> %yy{j}_{p}, <16 x i8> %mm{p}_{c})\n")
                total = name
            chains[chain, c] = total
    added, parts = _parts(form, chains, 8, f"%mms{j}")
    text += added
    for part, sums in parts.items():  # [r0 c2k, r0 c2k+1, r1 c2k, r1 c2k+1] per k -> each row's 16 columns in order
        for half, row in enumerate(dict.fromkeys((j, other))):
            pick = (0, 1, 4, 5) if half == 0 else (2, 3, 6, 7)
            quads = []
            for k in range(0, 8, 2):
                quads.append(f"%mq{row}_{part}_{k}")
                text += (f"  {quads[-1]} = shufflevector <4 x i32> {sums[k]}, <4 x i32> {sums[k + 1]}, "
                         f"<4 x i32> <{lanes(pick)}>\n")
            text += (f"  %mo{row}_{part}_0 = shufflevector <4 x i32> {quads[0]}, <4 x i32> {quads[1]}, "
                     f"<8 x i32> <{lanes(range(8))}>\n"
                     f"  %mo{row}_{part}_1 = shufflevector <4 x i32> {quads[2]}, <4 x i32> {quads[3]}, "
                     f"<8 x i32> <{lanes(range(8))}>\n"
                     f"  %ci{row}_{part} = shufflevector <8 x i32> %mo{row}_{part}_0, <8 x i32> %mo{row}_{part}_1, "
                     f"<16 x i32> <{lanes(range(16))}>\n")
    return text


SHARED = {"neon": _neon_weights, "i8mm": _i8mm_weights}  # a block's weights, for all rows
SUMS = {"vnni": _vnni_sums, "neon": _neon_sums, "i8mm": _i8mm_sums}  # a row's sums
EVERY_ROW = {"avx2": _avx2_sums}  # every row's sums, a half step at a time
ISAS = {  # the integer dot products' instruction sets: their entries in the capability table, the most rows a tile takes
    "vnni": ("q8 block tiles, vnni", 8),  # AVX512-VNNI's vpdpbusd: 32 registers of 16 lanes
    "avx2": ("q8 block tiles", 4),  # AVX2's vpmaddubsw and vpmaddwd (x86-64-v3): 16 registers of 8 lanes; 2 and 8
    # rows measured slower over 4 and 16 rows (the Qwen2.5-Coder-0.5B shape's MLP, 2-core AVX2); 3 for forms without
    # planes since the tiles run by halves (most_rows)
    "i8mm": ("q8 block tiles, i8mm", 4),  # ARM64's smmla (the int8 matrix multiply: Apple M2 on, Graviton 3 on),
    # two rows at a time: run emulated only (tests/emulated/arm64.py), not yet timed
    "neon": ("q8 block tiles, neon", 4),  # ARM64's sdot (the dot-product extension: Apple M1 on, Neoverse N1 on):
    # 32 registers of 4 lanes, as many bits as AVX2's; run emulated only (tests/emulated/arm64.py), not yet timed
}
DECLARATIONS = {
    "vnni": FMA_DECLARATION + "declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <64 x i8>, <64 x i8>)\n",
    "avx2": FMA_DECLARATION + "declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)\n"
    "declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)\n"
    "declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)\n"
    "declare <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8>, <32 x i8>)\ndeclare <32 x i8> @llvm.abs.v32i8(<32 x i8>, i1)\n",
    "neon": FMA_DECLARATION
    + "declare <4 x i32> @llvm.aarch64.neon.sdot.v4i32.v16i8(<4 x i32>, <16 x i8>, <16 x i8>)\n",
    "i8mm": FMA_DECLARATION
    + "declare <4 x i32> @llvm.aarch64.neon.smmla.v4i32.v16i8(<4 x i32>, <16 x i8>, <16 x i8>)\n",
}


def instruction_set() -> str | None:
    """The integer dot products this CPU runs the tiles in (capabilities.py: VNNI where present, else AVX2; on ARM64
    sdot), or None where it has none of them (float32 activations)."""
    return next((isa for isa, (kernel, _) in ISAS.items() if capabilities.available(kernel)), None)


def available() -> bool:
    """Whether this CPU runs the tiles (AVX2, AVX512-VNNI or ARM64's sdot)."""
    return instruction_set() is not None


def most_rows(form: Form, isa: str) -> int:
    """The most rows a tile of `form` takes in `isa`: ISAS'; on AVX2 three for a form without planes, whose halves'
    loops then keep their sums in registers (64 rows through the default model's projections, a 2-core AVX2 host,
    against four rows: nibbles 0.93-0.96x the time, bytes 0.72-0.86x; with planes four rows stay faster)."""
    return 3 if isa == "avx2" and not form.planes else ISAS[isa][1]


def source(form: Form, isa: str) -> tuple[str, list[str]]:
    """The IR module of `form`'s tiles in instruction set `isa` for 1..most_rows rows, and their names (the module
    also holds ROUND_IR's @round8, which `tiles` takes with them)."""
    names = [f"q8_{form.name}_{isa}_{rows}" for rows in range(1, most_rows(form, isa) + 1)]
    return DECLARATIONS[isa] + ROUND_DECLARATIONS + ROUND_IR + "".join(
        tile_ir(name, form, rows, isa) for rows, name in enumerate(names, start=1)), names


@functools.cache
def tiles(form: Form) -> np.ndarray:
    """`form`'s tiles compiled for this CPU's instruction set (`compiled_tiles`)."""
    isa = instruction_set()
    if isa is None:
        capabilities.check("q8 block tiles")  # MissingInstructions, naming what the AVX2 tiles need
    return compiled_tiles(form, isa)


def compiled_tiles(form: Form, isa: str) -> np.ndarray:
    """The addresses of `form`'s tiles in `isa` for one row and more (entry i takes i + 1 rows), then of @round8 (the
    last entry: `linear` rounds its rows with it)."""
    text, names = source(form, isa)
    return compile_ir(text, names + ["round8"], ISAS[isa][0])


def rounder() -> int:
    """The address of this CPU's @round8 (for rounded8's callers outside `linear`)."""
    return int(tiles(Form(nibbles=True))[-1])


ROUND_DECLARATIONS = ("declare <16 x float> @llvm.fabs.v16f32(<16 x float>)\n"
                      "declare <16 x float> @llvm.maxnum.v16f32(<16 x float>, <16 x float>)\n"
                      "declare float @llvm.vector.reduce.fmax.v16f32(<16 x float>)\n"
                      "declare <16 x float> @llvm.rint.v16f32(<16 x float>)\n"
                      "declare i32 @llvm.vector.reduce.add.v16i32(<16 x i32>)\n")
# @round8(x, blocks, xq, xd, xs, xh): one row of `blocks` blocks of 32 floats rounded to 8 bits (rounded8's xq, xd,
# xs and xh of that row), 16 lanes at a time: a = max |x| (exact in any order), xq = rint(x * (127 / a)) (0 where a
# is 0), xd = a / 127, xs = xd * float(sum of xq), xh = xd * float(each half's sum), every operation IEEE float32 as
# numba's scalar loop did it (which ran one element at a time: 12 us a 16-row, 576-wide input; 120 of them a forward)
ROUND_IR = (
    "define void @round8(ptr noalias %x, i64 %blocks, ptr noalias %xq, ptr noalias %xd, ptr noalias %xs, "
    "ptr noalias %xh) {\nentry:\n  br label %loop\nloop:\n"
    "  %b = phi i64 [ 0, %entry ], [ %b.next, %loop ]\n  %o0 = mul i64 %b, 32\n  %o1 = add i64 %o0, 16\n"
    + "".join(f"  %p{h} = getelementptr float, ptr %x, i64 %o{h}\n  %v{h} = load <16 x float>, ptr %p{h}, align 4\n"
              f"  %a{h} = call <16 x float> @llvm.fabs.v16f32(<16 x float> %v{h})\n" for h in (0, 1))
    + "  %a = call <16 x float> @llvm.maxnum.v16f32(<16 x float> %a0, <16 x float> %a1)\n"
    "  %top = call float @llvm.vector.reduce.fmax.v16f32(<16 x float> %a)\n"
    f"  %some = fcmp ogt float %top, 0.0\n  %ratio = fdiv float {constant(127.0)}, %top\n"
    "  %inverse = select i1 %some, float %ratio, float 0.0\n"
    "  %iv.v = insertelement <16 x float> poison, float %inverse, i64 0\n"
    "  %iv = shufflevector <16 x float> %iv.v, <16 x float> poison, <16 x i32> zeroinitializer\n"
    f"  %d = fdiv float %top, {constant(127.0)}\n"
    + "".join(f"  %s{h} = fmul <16 x float> %v{h}, %iv\n"
              f"  %r{h} = call <16 x float> @llvm.rint.v16f32(<16 x float> %s{h})\n"
              f"  %i{h} = fptosi <16 x float> %r{h} to <16 x i32>\n  %q{h} = trunc <16 x i32> %i{h} to <16 x i8>\n"
              f"  %qp{h} = getelementptr i8, ptr %xq, i64 %o{h}\n  store <16 x i8> %q{h}, ptr %qp{h}, align 1\n"
              f"  %n{h} = call i32 @llvm.vector.reduce.add.v16i32(<16 x i32> %i{h})\n"
              f"  %n{h}f = sitofp i32 %n{h} to float\n  %h{h} = fmul float %d, %n{h}f\n" for h in (0, 1))
    + "  %n = add i32 %n0, %n1\n  %nf = sitofp i32 %n to float\n  %sum = fmul float %d, %nf\n"
    "  %dp = getelementptr float, ptr %xd, i64 %b\n  store float %d, ptr %dp, align 4\n"
    "  %sp = getelementptr float, ptr %xs, i64 %b\n  store float %sum, ptr %sp, align 4\n"
    "  %hb = mul i64 %b, 2\n  %hp0 = getelementptr float, ptr %xh, i64 %hb\n  store float %h0, ptr %hp0, align 4\n"
    "  %hp1 = getelementptr float, ptr %hp0, i64 1\n  store float %h1, ptr %hp1, align 4\n"
    "  %b.next = add i64 %b, 1\n  %done = icmp eq i64 %b.next, %blocks\n"
    "  br i1 %done, label %end, label %loop\nend:\n  ret void\n}\n")

PARALLEL_ROWS = 8  # from this many rows, rows are rounded in parallel


@numba.njit(fastmath=False, parallel=True, cache=True, boundscheck=False)
def rounded8(x, round8):
    """x [rows, K] (rows of contiguous floats) rounded to 8 bits per block of 32 by @round8 (`round8`: its address):
    xq (int8), xd = a / 127 and xs = xd * sum(xq) [rows, K / 32], and xh [rows, K / 16], xd times each half's sum,
    where a is the block's largest magnitude and xq = rint(x * 127 / a)."""
    rows, size = x.shape
    xq = np.empty((rows, size), dtype=np.int8)
    xd = np.empty((rows, size // 32), dtype=np.float32)
    xs = np.empty((rows, size // 32), dtype=np.float32)
    xh = np.empty((rows, size // 16), dtype=np.float32)
    if rows >= PARALLEL_ROWS:
        for r in prange(rows):
            _round_row(x, r, round8, xq, xd, xs, xh)
    else:  # a parallel region costs more than a few rows
        for r in range(rows):
            _round_row(x, r, round8, xq, xd, xs, xh)
    return xq, xd, xs, xh


@numba.njit(inline="always", fastmath=False, cache=True, boundscheck=False)
def _round_row(x, r, round8, xq, xd, xs, xh):
    """Row r of x into row r of xq, xd, xs and xh by @round8."""
    call(round8, x.ctypes.data + r * x.strides[0], x.shape[1] // 32, xq[r].ctypes.data, xd[r].ctypes.data,
         xs[r].ctypes.data, xh[r].ctypes.data)


@numba.njit(fastmath=False, parallel=True, cache=True, boundscheck=False)
def linear(x, weight):
    """x [rows, K] (float32, contiguous) times the repacked weight (q, s, tiles, N, groups a chunk): [rows, N]."""
    q, s, tile, outputs, chunk_groups = weight
    most = len(tile) - 1  # the tiles for 1..most rows, then @round8
    if x.strides[1] != 4:
        x = np.ascontiguousarray(x)
    xq, xd, xs, xh = rounded8(x, tile[most])
    rows, size = x.shape
    groups = q.shape[0]
    out = np.empty((rows, groups * COLUMNS), dtype=np.float32)
    for chunk in prange((groups + chunk_groups - 1) // chunk_groups):
        # the addresses are taken here, in the loop: taken before it, numba may free the arrays once they are read
        X, Q, S, O, XD, XS, XH = xq.ctypes.data, q.ctypes.data, s.ctypes.data, out.ctypes.data, xd.ctypes.data, \
            xs.ctypes.data, xh.ctypes.data
        r = 0
        while r < rows:
            take = min(most, rows - r)
            for g in range(chunk * chunk_groups, min(groups, chunk * chunk_groups + chunk_groups)):
                call(tile[take - 1], X, size, Q, S, g, O, groups * COLUMNS, r, XD, XS, XH)
            r += take
    if outputs == groups * COLUMNS:
        return out
    return np.ascontiguousarray(out[:, :outputs])


REPACK_ROWS = 4096  # rows repacked at a time (a multiple of COLUMNS): a 152k-row output layer's temporaries stay small


def repack(bits: int, rows: int, integers, planes: int = 0) -> tuple:
    """`packed`'s arrays for this CPU's instruction set, with the tiles compiled: what `linear` takes."""
    return compiled(packed(bits, rows, integers, instruction_set() or "avx2", planes))


def compiled(weight: tuple) -> tuple:
    """What `linear` takes for `packed`'s tuple (made here, or kept on disk: forward/repacked.py): its form's tiles
    compiled for this CPU in place of the form."""
    q, held, form, rows, chunk_groups = weight
    return q, held, tiles(form), rows, chunk_groups


PLANES = ("vnni", "avx2")  # the instruction sets whose tiles take five- and six-bit weights as nibbles and planes
OFFSETS = (8, 16, 32, 128)  # m = -offset d: Q4_0's, Q5_0's, Q6_K's (as q8_tiles holds them unsigned), bytes on VNNI
# the GGUF types' bits a weight: where a tensor's (or a fused tensor's) most are 5 or 6, the PLANES tiles hold its
# weights as nibbles and planes past 4 bits (a Q4_K_M file's q/k/v fused from Q4_K and Q6_K blocks: 6 bits)
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}


def packed(bits: int, rows: int, integers, isa: str, planes: int = 0) -> tuple:
    """A GGUF tensor's blocks as the tiles of instruction set `isa` read them, from `integers(first, last)`: (q, d,
    m) of rows first..last, q [rows, B, 32] integers (bits 4: nibbles 0..15, with a minimum m; bits 8: signed
    bytes), d and m [rows, B, scales] (block_tiles.Blocks.integers; m None: none), and optionally the K-quant
    super-blocks' bases (Blocks.base: the scales are then held as bytes, `_factors`), taken REPACK_ROWS rows at a
    time. Columns are padded to a multiple of 16 with zero weights. Every instruction set takes every form:
    vpdpbusd takes the stored bytes as unsigned, so for the VNNI tiles a byte form's minimum is less 128 d (w = (q + 128) d + m - 128 d).
    `planes` 1 or 2: the blocks are five- or six-bit weights, which the VNNI and AVX2 tiles hold as nibbles and
    planes of the higher bits (0.625 and 0.75 bytes a weight against a byte; BITS): a block of signed weights
    (Q5_0's, Q6_K's) plus 16 or 32, its minimum less 16 or 32 d. (q, scales, form, rows, column groups a thread takes at a
    time)."""
    stepped, slots, bases, minimum = None, [], [], False
    planes = planes if isa in PLANES and bits == 8 else 0
    stored = 4 + planes if planes else bits  # the bits _steps lays out
    for first in range(0, rows, REPACK_ROWS):
        q, d, m, *base = integers(first, min(rows, first + REPACK_ROWS))
        bases.append(base[0] if base else None)
        if planes:
            half = 8 << planes
            shift = (q.min(axis=2, keepdims=True) < 0) * q.dtype.type(half)  # (in q's type: int64 took 4x longer)
            q, m = q + shift, (0 if m is None else m) - shift * d
            if q.min(initial=0) < 0 or q.max(initial=0) >= 2 * half:
                raise ValueError(f"not {stored}-bit weights")
        elif isa == "vnni" and bits == 8:
            m = -128 * d if m is None else m - 128 * d
        minimum = m is not None
        part = _steps(stored, q, shifted=isa == "avx2")
        if stepped is None:  # (filled a chunk at a time: a 152k-row output layer's steps held once, not twice)
            stepped = np.empty((-(-rows // COLUMNS), part.shape[1]), np.uint8)
        stepped[first // COLUMNS : first // COLUMNS + part.shape[0]] = part
        slots.append(np.concatenate([d] + ([] if m is None else [m]), axis=2).astype(np.float32))
        del q, d, m, part
    slots = np.concatenate(slots)
    _, blocks, count = slots.shape
    scales = count // (2 if minimum else 1)
    offset = next((k for k in OFFSETS if minimum and np.array_equal(slots[:1, :, scales:], -k * slots[:1, :, :scales])
                   and np.array_equal(slots[..., scales:], -k * slots[..., :scales])), 0)  # (the first row first)
    if offset:  # the minimums are -offset d: formed in the tile, not read
        slots, count = np.ascontiguousarray(slots[..., :scales]), scales
    factors = _factors(slots, bases, scales)  # (1.5 bytes a scale, against float16's 2 and float32's 4)
    wide = factors is None and not np.array_equal(slots.astype(np.float16).astype(np.float32), slots)
    form = Form(stored < 8, scales, minimum, wide, planes, offset, factors is not None)
    groups = -(-rows // COLUMNS)

    def by_group(values: np.ndarray) -> np.ndarray:  # [rows, a, b] -> [group, a, b, column], padded with zeros
        padded = np.zeros((groups * COLUMNS, *values.shape[1:]), values.dtype)
        padded[:rows] = values
        return np.ascontiguousarray(padded.reshape(groups, COLUMNS, *values.shape[1:]).transpose(0, 2, 3, 1))

    if factors is not None:
        held = np.concatenate([by_group(f).reshape(groups, -1).view(np.uint8) for f in factors], axis=1)
    else:
        held = by_group(slots.astype(np.float32 if wide else np.float16)).reshape(groups, -1).view(np.uint8)
    group_bytes = stepped.shape[1] + held.shape[1]
    return (stepped, held, form, rows, max(1, CHUNK_BYTES // group_bytes))


SUPER = 8  # blocks of 32 in a K-quant super-block


def _factors(slots: np.ndarray, bases: list, scales: int) -> tuple | None:
    """The scales [rows, B, count] as K-quant files hold them, where they can be: a signed byte each [rows, B, count]
    times its super-block's base [rows, B / 8, kinds] (the d's base, then the m's), every product equal to the
    scale in float32; None where a part has no bases (not a K-quant) or a scale is not such a product (an offset
    folded into a minimum)."""
    if any(base is None for base in bases) or slots.shape[1] % SUPER:
        return None
    base = np.concatenate(bases)
    count = slots.shape[2]
    kinds = 1 + (count > scales)
    base = np.ascontiguousarray(base[:, :, :kinds], np.float32)
    ints = np.empty(slots.shape, np.int8)
    return (ints, base) if _factor_bytes(np.ascontiguousarray(slots, np.float32), base, scales, ints) else None


@numba.njit(parallel=True, cache=True, boundscheck=False)
def _factor_bytes(slots, base, scales, ints):
    """ints[r, b, j] = slots[r, b, j] / its base (base[r, b // SUPER]: the d's for the first `scales`, else the
    m's), rounded, in float32; whether every one is a signed byte whose product with the base is the scale."""
    rows, blocks, count = slots.shape
    exact = np.ones(rows, np.bool_)
    for r in prange(rows):
        for b in range(blocks):
            for j in range(count):
                each = base[r, b // SUPER, 0 if j < scales else base.shape[2] - 1]
                found = np.float32(np.rint(np.float32(slots[r, b, j] / each))) if each != 0 else np.float32(0)
                if found < -128 or found > 127 or np.float32(found * each) != slots[r, b, j]:
                    exact[r] = False
                    found = np.float32(0)
                ints[r, b, j] = np.int8(found)
    return exact.all()


def _steps(bits: int, q: np.ndarray, shifted: bool = False) -> np.ndarray:
    """q [rows, B, 32] as the tiles read it, [groups, B * Form.block_bytes] bytes: per block, step p holds weights
    4p..4p + 3 of each of 16 columns (nibbles: step p in the low nibbles, step p + 4 in the high ones; bits 5 and
    6: those nibbles of 0..31 or 0..63, then 64 bytes for each higher bit; bytes: the signed values plus 128). Rows
    past the last are zero weights. The higher bits, for the VNNI tiles' byte masks: a plane per bit, each step's 64
    bits in the order of its bytes, least significant first. `shifted`, for AVX2's shifts: 32-byte vectors whose
    byte i holds, for byte i of half h (columns 8h..8h + 7) of each of 8 / n steps (n: 1 or 2 higher bits), those
    bits as a field of n bits (step p: vector 2 (p // (8 / n)) + h, field p % (8 / n), lowest first)."""
    rows, blocks, _ = q.shape
    block_bytes = {8: 512, 4: 256}.get(bits, 256 + 64 * (bits - 4))
    out = np.zeros((-(-rows // COLUMNS), blocks * block_bytes), np.uint8)
    _lay_steps(q, bits, block_bytes, out, shifted)
    return out


@numba.njit(parallel=True, cache=True, boundscheck=False)
def _lay_steps(q, bits, block_bytes, out, shifted):
    """_steps' bytes into out (zeros), a group of COLUMNS rows a task (numpy's transposes and bit packing took 4 of
    a 1.7B Q4_K_M's 20-second first load)."""
    rows, blocks = q.shape[0], q.shape[1]
    for g in prange(out.shape[0]):
        for c in range(COLUMNS):
            r = g * COLUMNS + c
            for b in range(blocks):
                at = b * block_bytes
                for p in range(8 if bits == 8 else 4):
                    for w in range(4):
                        place = at + (p * COLUMNS + c) * 4 + w
                        if r >= rows:  # zero weights: (stored plus 128 as bytes)
                            out[g, place] = 128 if bits == 8 else 0
                        elif bits == 8:  # (signed bytes wrap to 128..255, plus 128 back to 0..255)
                            out[g, place] = np.uint8((q[r, b, 4 * p + w] + 128) & 255)
                        else:  # step p in the low nibbles, step p + 4 in the high ones
                            out[g, place] = np.uint8((q[r, b, 4 * p + w] & 15) | ((q[r, b, 4 * p + 16 + w] & 15) << 4))
                if bits in (5, 6) and r < rows:  # each higher bit where `_steps` says, by layout
                    n, fields = bits - 4, 8 // (bits - 4)
                    for bit in range(4, bits):
                        for p in range(8):
                            for w in range(4):
                                if shifted:  # byte (c % 8) 4 + w of vector 2 (p // fields) + c // 8, an n-bit field
                                    place = at + 256 + (2 * (p // fields) + c // 8) * 32 + (c % 8) * 4 + w
                                    field = n * (p % fields) + bit - 4
                                else:  # bit (c % 2) 4 + w of byte c // 2 of step p's 8 in the bit's plane
                                    place = at + 256 + (bit - 4) * 64 + p * 8 + c // 2
                                    field = (c % 2) * 4 + w
                                out[g, place] |= np.uint8(((q[r, b, 4 * p + w] >> bit) & 1) << field)
