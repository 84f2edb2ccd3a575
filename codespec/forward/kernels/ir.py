"""The vocabulary the LLVM IR kernels are written in: 16-lane float vectors, a scalar broadcast, float constants,
a vector exp, adding 16 vectors of partial sums down to one, and a `values` tile's running sums. Plain IR: it
compiles for any target (AVX-512, AVX2, NEON); an instruction set's intrinsics stay in the kernel that needs them
(capabilities.py)."""

from __future__ import annotations

import struct

import numpy as np

VECTOR = "<16 x float>"
FMA = "@llvm.fma.v16f32"
FMA_DECLARATION = f"declare {VECTOR} {FMA}({VECTOR}, {VECTOR}, {VECTOR})\n"


def splat(name: str, pointer: str, vector: str, scalar: str, count: int = 16) -> str:
    """%name = the `scalar` at `pointer` in every lane of `vector` (`count` lanes)."""
    return (f"  %{name}.s = load {scalar}, ptr {pointer}, align 4\n"
            f"  %{name}.v = insertelement {vector} poison, {scalar} %{name}.s, i64 0\n"
            f"  %{name} = shufflevector {vector} %{name}.v, {vector} poison, <{count} x i32> zeroinitializer\n")


# 2^f on [-1/2, 1/2]: a degree-5 polynomial fitted for relative error on Chebyshev nodes (within 1.5e-7)
EXP2 = (1.0000001192092896, 0.6931469440460205, 0.24022121727466583, 0.05550742521882057, 0.009675459936261177,
        0.0013266970636323094)
LOG2E = 1.4426950216293335  # float32(log2 e)
EXP_DECLARATIONS = ("declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)\n"
                    "declare <16 x float> @llvm.roundeven.v16f32(<16 x float>)\n"
                    "declare <16 x i32> @llvm.smax.v16i32(<16 x i32>, <16 x i32>)\n"
                    "declare <16 x i32> @llvm.smin.v16i32(<16 x i32>, <16 x i32>)\n")


def constant(value: float) -> str:
    """A float32 constant as LLVM IR writes it (the double of the same value, in hex)."""
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", float(np.float32(value))))[0]


def exp_ir(out: str, x: str, shift: str = "zeroinitializer") -> str:
    """%out = 2^(x log2(e) + shift) for 16 floats (shift: a vector, e.g. -max log2(e) for a softmax): 2^n times 2^f,
    f = t - n in [-1/2, 1/2] as a degree-5 polynomial in FMAs (within about 1e-6 where |t| < 20: t itself is rounded
    to float). 2^n is built from its exponent bits, n clamped to [-127, 128]: below float's normal range that is 0,
    above it infinity (as vscalefps gives, apart from denormal results, which no softmax or SiLU sum can see). Plain
    IR, so it compiles for any target (AVX-512, AVX2, NEON). LLVM has no vector exp of its own (numba's loops call
    expf once per element). Needs EXP_DECLARATIONS."""
    v = "<16 x float>"
    i = "<16 x i32>"
    text = (f"  %{out}.t = call {v} @llvm.fma.v16f32({v} {x}, {v} splat (float {constant(LOG2E)}), {v} {shift})\n"
            f"  %{out}.n = call {v} @llvm.roundeven.v16f32({v} %{out}.t)\n  %{out}.f = fsub {v} %{out}.t, %{out}.n\n"
            f"  %{out}.nc = fptosi {v} %{out}.n to {i}\n"  # out of i32's range (|t| >= 2^31, or NaN): poison, clamped
            f"  %{out}.lo = call {i} @llvm.smax.v16i32({i} %{out}.nc, {i} splat (i32 -127))\n"
            f"  %{out}.ni = call {i} @llvm.smin.v16i32({i} %{out}.lo, {i} splat (i32 128))\n"
            f"  %{out}.nb = add {i} %{out}.ni, splat (i32 127)\n  %{out}.ns = shl {i} %{out}.nb, splat (i32 23)\n"
            f"  %{out}.two = bitcast {i} %{out}.ns to {v}\n")
    previous = f"splat (float {constant(EXP2[-1])})"
    for k, term in enumerate(reversed(EXP2[:-1])):
        text += (f"  %{out}.p{k} = call {v} @llvm.fma.v16f32({v} {previous}, {v} %{out}.f, "
                 f"{v} splat (float {constant(term)}))\n")
        previous = f"%{out}.p{k}"
    return text + f"  %{out} = fmul {v} {previous}, %{out}.two\n"


SOFTMAX_DECLARATIONS = "".join(f"declare {d}\n" for d in (
    f"{VECTOR} @llvm.maxnum.v16f32({VECTOR}, {VECTOR})", f"float @llvm.vector.reduce.fmax.v16f32({VECTOR})",
    f"{VECTOR} @llvm.masked.load.v16f32.p0(ptr, i32, <16 x i1>, {VECTOR})",
    f"float @llvm.vector.reduce.fadd.v16f32(float, {VECTOR})"))


def softmax_ir(name: str, bfloat16: bool) -> str:
    """@name(s, valid, w, width, inverse, unused): a row's softmax over its own keys s[:valid], zero weights in
    w[valid:width] (width a multiple of 16). With `bfloat16`: w[:valid] = exp(s - max) as bfloat16 (the largest
    weight 1) and inverse[0] = 1 / their sum (in float32, before the rounding), so that a values tile's sums times it
    are the attention (one multiply per row and dimension instead of one per weight); else w[:valid] = exp(s - max) /
    their sum in float32 and `inverse` is not touched. 16 lanes at a time; only the last, partial block is masked.
    The row's sums run over its own keys only, in one order fixed here (the partial block first, then the blocks in
    order, then the 16 lanes added down), whatever calls it: numba's fast-math loops let LLVM pick the order of a
    sum by what it was inlined into, and a process that compiled a kernel afresh could differ in the last bit from
    one that loaded it from numba's cache. Needs EXP_DECLARATIONS and SOFTMAX_DECLARATIONS."""
    v = VECTOR
    out, align = ("<16 x bfloat>", 2) if bfloat16 else (v, 4)
    scalar = "bfloat" if bfloat16 else "float"

    def stored(value: str, name: str, offset: str) -> str:  # 16 weights into w[offset:]
        if not bfloat16:
            return f"  %{name}.q = getelementptr float, ptr %w, i64 {offset}\n  store {v} {value}, ptr %{name}.q, align 4\n"
        return (f"  %{name}.h = fptrunc {v} {value} to {out}\n  %{name}.q = getelementptr bfloat, ptr %w, i64 {offset}\n"
                f"  store {out} %{name}.h, ptr %{name}.q, align 2\n")

    indices = "<i32 " + ", i32 ".join(str(i) for i in range(16)) + ">"
    minus = "splat (float 0xFFF0000000000000)"
    text = (f"define void @{name}(ptr noalias %s, i64 %valid, ptr noalias %w, i64 %width, ptr noalias %inverse, "
            "i64 %unused) {\nentry:\n  %full = lshr i64 %valid, 4\n  %rest = and i64 %valid, 15\n"
            "  %rest.nz = icmp ne i64 %rest, 0\n  %rest.any = zext i1 %rest.nz to i64\n"
            "  %rest.t = trunc i64 %rest to i32\n  %rest.i = insertelement <16 x i32> poison, i32 %rest.t, i64 0\n"
            "  %rest.s = shufflevector <16 x i32> %rest.i, <16 x i32> poison, <16 x i32> zeroinitializer\n"
            f"  %tail = icmp ult <16 x i32> {indices}, %rest.s\n  %tail.o = shl i64 %full, 4\n"
            "  %tail.p = getelementptr float, ptr %s, i64 %tail.o\n"
            f"  %tail.x = call {v} @llvm.masked.load.v16f32.p0(ptr %tail.p, i32 4, <16 x i1> %tail, {v} {minus})\n"
            "  %some = icmp ne i64 %full, 0\n  br i1 %some, label %top, label %top.end\n"
            "top:\n  %i = phi i64 [ 0, %entry ], [ %i.next, %top ]\n"
            f"  %m = phi {v} [ %tail.x, %entry ], [ %m.next, %top ]\n  %a.o = shl i64 %i, 4\n"
            f"  %a.p = getelementptr float, ptr %s, i64 %a.o\n  %a.x = load {v}, ptr %a.p, align 4\n"
            f"  %m.next = call {v} @llvm.maxnum.v16f32({v} %m, {v} %a.x)\n  %i.next = add i64 %i, 1\n"
            "  %i.done = icmp eq i64 %i.next, %full\n  br i1 %i.done, label %top.end, label %top\n"
            f"top.end:\n  %m.all = phi {v} [ %tail.x, %entry ], [ %m.next, %top ]\n"
            f"  %most = call float @llvm.vector.reduce.fmax.v16f32({v} %m.all)\n"
            f"  %shift = fmul float %most, {constant(-LOG2E)}\n"
            f"  %shift.i = insertelement {v} poison, float %shift, i64 0\n"
            f"  %shift.s = shufflevector {v} %shift.i, {v} poison, <16 x i32> zeroinitializer\n"
            + exp_ir("t.e", "%tail.x", "%shift.s") +
            f"  %t.z = select <16 x i1> %tail, {v} %t.e, {v} zeroinitializer\n"
            "  br i1 %some, label %exp, label %exp.end\n"
            "exp:\n  %j = phi i64 [ 0, %top.end ], [ %j.next, %exp ]\n"
            f"  %t = phi {v} [ %t.z, %top.end ], [ %t.next, %exp ]\n  %b.o = shl i64 %j, 4\n"
            f"  %b.p = getelementptr float, ptr %s, i64 %b.o\n  %b.x = load {v}, ptr %b.p, align 4\n"
            + exp_ir("b.e", "%b.x", "%shift.s") + stored("%b.e", "b", "%b.o") + f"  %t.next = fadd {v} %t, %b.e\n  %j.next = add i64 %j, 1\n"
            "  %j.done = icmp eq i64 %j.next, %full\n  br i1 %j.done, label %exp.end, label %exp\n"
            f"exp.end:\n  %t.all = phi {v} [ %t.z, %top.end ], [ %t.next, %exp ]\n"
            f"  %total = call reassoc float @llvm.vector.reduce.fadd.v16f32(float 0.0, {v} %t.all)\n"
            "  %inv = fdiv float 1.0, %total\n")
    text += ("  store float %inv, ptr %inverse, align 4\n" if bfloat16 else "")
    text += ("  br i1 %rest.nz, label %last, label %fill\n"
             "last:\n" + stored("%t.z", "t", "%tail.o")
             + "  br label %fill\nfill:\n  %blocks = add i64 %full, %rest.any\n  %from = shl i64 %blocks, 4\n")
    if not bfloat16:  # each weight times the inverse of the sum
        text += (f"  %inv.i = insertelement {v} poison, float %inv, i64 0\n"
                 f"  %inv.s = shufflevector {v} %inv.i, {v} poison, <16 x i32> zeroinitializer\n"
                 "  %any = icmp ne i64 %blocks, 0\n  br i1 %any, label %scale, label %scaled\n"
                 "scale:\n  %c = phi i64 [ 0, %fill ], [ %c.next, %scale ]\n  %c.o = shl i64 %c, 4\n"
                 f"  %c.p = getelementptr float, ptr %w, i64 %c.o\n  %c.x = load {v}, ptr %c.p, align 4\n"
                 f"  %c.y = fmul {v} %c.x, %inv.s\n  store {v} %c.y, ptr %c.p, align 4\n"
                 "  %c.next = add i64 %c, 1\n  %c.done = icmp eq i64 %c.next, %blocks\n"
                 "  br i1 %c.done, label %scaled, label %scale\nscaled:\n")
    return text + ("  %empty = icmp uge i64 %from, %width\n  br i1 %empty, label %exit, label %zero\n"
                   f"zero:\n  %z = phi i64 [ %from, %{'fill' if bfloat16 else 'scaled'} ], [ %z.next, %zero ]\n"
                   f"  %z.p = getelementptr {scalar}, ptr %w, i64 %z\n"
                   f"  store {out} zeroinitializer, ptr %z.p, align {align}\n"
                   "  %z.next = add i64 %z, 16\n  %z.done = icmp uge i64 %z.next, %width\n"
                   "  br i1 %z.done, label %exit, label %zero\nexit:\n  ret void\n}\n")


def lanes(picks) -> str:
    return ", ".join(f"i32 {i}" for i in picks)


def add_down(sums: list[str], vector: str, add: str, prefix: str, codes: list[str] | None = None) -> tuple[str, str]:
    """16 vectors of 16 partial sums each (one per key) added down to one vector of the 16 keys' sums, in key order:
    each step halves every key's lanes, two vectors into one (45 shuffles and adds instead of 16 x 8). With `codes`
    (each key's code, which forms its vector in `sums`), the same tree is emitted depth first, each key's code just
    before the additions that take it, so that few vectors are live at once: the same operations."""
    widths = (8, 4, 2, 1)

    def combine(step: int, i: int, left: str, right: str) -> str:
        width = widths[step]
        first = [lane for lane in range(32) if (lane // width) % 2 == 0]
        second = [lane for lane in range(32) if (lane // width) % 2 == 1]
        name = f"%{prefix}{step}_{i}"
        return (f"  {name}.a = shufflevector {vector} {left}, {vector} {right}, <16 x i32> <{lanes(first)}>\n"
                f"  {name}.b = shufflevector {vector} {left}, {vector} {right}, <16 x i32> <{lanes(second)}>\n"
                f"  {name} = {add} {vector} {name}.a, {name}.b\n")

    if codes is not None:
        def tree(first: int, size: int) -> tuple[str, str]:
            if size == 1:
                return codes[first], sums[first]
            (left_code, left), (right_code, right) = tree(first, size // 2), tree(first + size // 2, size // 2)
            step = size.bit_length() - 2
            return (left_code + right_code + combine(step, first // size, left, right),
                    f"%{prefix}{step}_{first // size}")
        return tree(0, 16)
    text = ""
    for step in range(len(widths)):
        text += "".join(combine(step, i, sums[2 * i], sums[2 * i + 1]) for i in range(len(sums) // 2))
        sums = [f"%{prefix}{step}_{i}" for i in range(len(sums) // 2)]
    return text, sums[0]


def running_sums(rows: int, chunks: int, loop: str, start: str = "") -> str:
    """The head of a `values` tile's loop: each row's 16-lane sums %a{r}_{c}, zero on entry (or, with `start`, the
    entry block's %{start}{r}_{c}: initial_sums), %a{r}_{c}.next after each step of block `loop`."""
    return "".join(f"  %a{r}_{c} = phi {VECTOR} [ {_initial(start, r, c)}, %entry ], [ %a{r}_{c}.next, {loop} ]\n"
                   for r in range(rows) for c in range(chunks))


def _initial(start: str, r: int, c: int) -> str:
    return f"%{start}{r}_{c}" if start else "zeroinitializer"


def initial_sums(rows: int, chunks: int, dim: int, flag: str, start: str = "i") -> str:
    """For the entry block of a `values` tile that may go on from earlier sums: %{start}{r}_{c} = out's sums [rows,
    dim] where the i64 `flag` is not 0, else zero (out is read either way: it must be a buffer of that size)."""
    text = f"  %{start}.on = icmp ne i64 {flag}, 0\n"
    for r in range(rows):
        for c in range(chunks):
            n = f"{start}{r}_{c}"
            text += (f"  %{n}.p = getelementptr float, ptr %out, i64 {r * dim + c * 16}\n"
                     f"  %{n}.l = load {VECTOR}, ptr %{n}.p, align 4\n"
                     f"  %{n} = select i1 %{start}.on, {VECTOR} %{n}.l, {VECTOR} zeroinitializer\n")
    return text


def stored_sums(rows: int, chunks: int, dim: int, loop: str, start: str = "") -> str:
    """The end of a `values` tile: each row's 16-lane sums %a{r}_{c}.next (from block `loop`; the initial sums, zero
    or `start`'s (running_sums), when the loop never ran) stored into out [rows, dim], and the return."""
    text = "".join(f"  %f{r}_{c} = phi {VECTOR} [ {_initial(start, r, c)}, %entry ], [ %a{r}_{c}.next, {loop} ]\n"
                   for r in range(rows) for c in range(chunks))
    text += "".join(f"  %so{r}_{c} = getelementptr float, ptr %out, i64 {r * dim + c * 16}\n"
                    f"  store {VECTOR} %f{r}_{c}, ptr %so{r}_{c}, align 4\n" for r in range(rows) for c in range(chunks))
    return text + "  ret void\n}\n"
