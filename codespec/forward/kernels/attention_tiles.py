"""The two halves of few-row attention as LLVM IR tiles, for float32, float16 and q8 caches (attention.py drives
them).

numba vectorises a dot product over the head's 64 dimensions as 16-lane partial sums, then adds each sum's lanes
down one by one: for a handful of query rows against thousands of keys, those horizontal adds cost more than the
multiplies. Here:

- `scores`: 16 keys at a time against one query row, each key's 16-lane partial sum kept apart, and the 16 sums
  added down together (a transpose of 45 shuffles and adds instead of 16 x 8). The block's keys are read from memory
  once for all the rows of a (sequence, KV head) and served from L1 after; from a float16 cache they are widened
  once per block into a 4 KB buffer, not once per row (8 sessions x 2,000 keys, one row each: 17.2 -> 15.7 ms).
- `values`: each value row read (and, from float16, widened) once and added, times its weight, into up to four
  query rows whose sums stay in registers (on AVX2 a part of their dimensions at a time: `value_parts`).
- On AVX2 (16 vector registers, each half a 16-lane vector) `scores` forms each key's sums and adds them into the
  tree at once (ir.add_down, depth first): the same operations in another order, with few vectors live. 16 rows
  over 900 cached keys, a forward of the default model on a 2-core AVX2 host: 50 -> 41 ms.
- q8 caches (`--cache-type q8`): `scores` takes query rows rounded to 8 bits as well, and one vpdpbusd forms a
  key's 64 products with a row in 16 integer lanes (the same adding down after); `values` widens each row's
  integers and multiplies them by its scale. 8 sessions x 2,000 keys, one row each: 14.8 -> 11.5 ms. AVX2 has no
  vpdpbusd: there each 16 of a key's bytes are widened to 16 bits and multiplied in vpmaddwd, exact sums as well,
  so an AVX2 CPU scores a q8 cache with a VNNI CPU's bits.

Each (query row, key) is the same sequence of instructions whichever rows share the forward, and each row's
weighted sum adds its values in position order: a row's attention does not depend on its batch (the caller pads
the keys to a multiple of 16 and gives a row exactly-zero weights past its position).
Compiled for this CPU on first use (native.py), as block_tiles.py's tiles.
"""

from __future__ import annotations

import functools

import numpy as np

from . import capabilities
from .ir import (EXP_DECLARATIONS, FMA, SOFTMAX_DECLARATIONS, VECTOR, add_down, initial_sums, lanes, running_sums,
                 softmax_ir, stored_sums)
from .native import compile_ir

DECLARATIONS = EXP_DECLARATIONS + SOFTMAX_DECLARATIONS  # (FMA's among them)
GROUP = 4  # query rows that `values` adds into at once, their sums in registers (on AVX2 a part at a time)


NARROW_SUMS = 64  # floats of sums a `values` tile keeps live on AVX2 (and ARM64): 8 of its 16 registers


def value_parts(dim: int, rows: int, wide_registers: bool) -> int:
    """The parts a `values` tile of `rows` rows sums a head's `dim` dimensions in (values_ir): one with AVX-512's 32
    registers; elsewhere (AVX2, ARM64), whose 16 registers hold one query row's four 16-lane sums and no more (two
    rows' spilled to the stack on every value), the fewest that keep the rows' sums within NARROW_SUMS: for a head
    of 64, one row whole, two rows in halves, three and four in quarters, each value row's part read once for all
    of them. 192 query rows over 704 float32 values, a 2-core AVX2 host: 3.40 ns a row and key one row at a time,
    2.09 four at a time in quarters (decoding, whose three rows a head split 1 : 2 between two threads, reads a
    row's values whole: in quarters its attention took 5.5-5.8 ms a token against 4.4-5.0)."""
    if wide_registers:
        return 1
    chunks = dim // 16
    return next(p for p in range(1, chunks + 1) if chunks % p == 0 and (dim // p * rows <= NARROW_SUMS or p == chunks))


ELEMENTS = {4: ("float", VECTOR), 2: ("half", "<16 x half>"), 1: ("i8", "<16 x i8>")}  # cache element bytes: LLVM
# scalar and vector types (1: --cache-type q8, each key's or value's dim int8 followed by its float32 scale)


def row_bytes(dim: int, itemsize: int) -> int:
    """Bytes of one cached key (or value) of a head: dim elements, and for q8 the float32 scale after them."""
    return dim * itemsize if itemsize > 1 else dim + 4


def _load(name: str, pointer: str, itemsize: int, scale: str = "") -> str:
    """%name = 16 cache elements at %pointer as float32 lanes (widened from float16 when the cache holds those; for
    q8, integers times the splat `scale` of their row)."""
    scalar, vector = ELEMENTS[itemsize]
    if itemsize == 4:
        return f"  %{name} = load {VECTOR}, ptr {pointer}, align 4\n"
    if itemsize == 2:
        return (f"  %{name}.h = load {vector}, ptr {pointer}, align 2\n"
                f"  %{name} = fpext {vector} %{name}.h to {VECTOR}\n")
    return (f"  %{name}.b = load {vector}, ptr {pointer}, align 1\n"
            f"  %{name}.i = sext {vector} %{name}.b to <16 x i32>\n"
            f"  %{name}.f = sitofp <16 x i32> %{name}.i to {VECTOR}\n  %{name} = fmul {VECTOR} %{name}.f, {scale}\n")


def _scale(name: str, row: str, dim: int) -> str:
    """%name = the float32 scale of the q8 row at %row (after its dim integers), splat over 16 lanes."""
    return (f"  %{name}.p = getelementptr i8, ptr {row}, i64 {dim}\n  %{name}.s = load float, ptr %{name}.p, align 1\n"
            f"  %{name}.v = insertelement {VECTOR} poison, float %{name}.s, i64 0\n"
            f"  %{name} = shufflevector {VECTOR} %{name}.v, {VECTOR} poison, <16 x i32> zeroinitializer\n")


def scores_ir(dim: int, itemsize: int, depth_first: bool = False) -> str:
    """@scores{itemsize}(q, rows, k, count, out, width): out[r * width + j] = q[r] . k[j] for rows r (q [rows, dim]
    float32) and keys j < count (a multiple of 16; k [count, dim] of the cache's elements); dim a multiple of 16."""
    scalar, _ = ELEMENTS[itemsize]
    text = (f"define void @scores{itemsize}(ptr noalias %q, i64 %rows, ptr noalias %k, i64 %count, ptr noalias %out, "
            "i64 %width) {\nentry:\n  %blocks = udiv i64 %count, 16\n  %none = icmp eq i64 %blocks, 0\n"
            f"  %wide = alloca [{16 * dim} x float], align 64\n"
            "  br i1 %none, label %exit, label %block\nblock:\n  %b = phi i64 [ 0, %entry ], [ %b.next, %next ]\n"
            "  %kb = mul i64 %b, 16\n")
    keys, key_type = "%k", scalar
    if itemsize != 4:  # the block's keys widened once into %wide, for all the rows (not once per row)
        text += f"  %kbo = mul i64 %kb, {dim}\n  %kbp = getelementptr {scalar}, ptr %k, i64 %kbo\n"
        for c in range(dim):  # 16 keys x dim elements, 16 at a time
            text += (f"  %wsrc{c} = getelementptr {scalar}, ptr %kbp, i64 {c * 16}\n"
                     + _load(f"wv{c}", f"%wsrc{c}", itemsize)
                     + f"  %wdst{c} = getelementptr float, ptr %wide, i64 {c * 16}\n"
                     f"  store {VECTOR} %wv{c}, ptr %wdst{c}, align 64\n")
        keys, key_type = "%wide", "float"
    text += ("  br label %row\nrow:\n  %r = phi i64 [ 0, %block ], [ %r.next, %row ]\n"
             f"  %qo = mul i64 %r, {dim}\n")
    for c in range(dim // 16):
        text += (f"  %qo{c} = add i64 %qo, {c * 16}\n  %qp{c} = getelementptr float, ptr %q, i64 %qo{c}\n"
                 f"  %qv{c} = load {VECTOR}, ptr %qp{c}, align 4\n")

    def key_sum(key: int) -> tuple[list[str], str]:  # the key's 16-lane sums: one FMA a chunk of dim, in order
        steps, total = [], "zeroinitializer"
        for c in range(dim // 16):
            n = f"{c}_{key}"
            first = "%kb" if keys == "%k" else "0"  # the key's row: in the cache, or in the widened block
            steps.append(f"  %ki{n} = add i64 {first}, {key}\n  %kr{n} = mul i64 %ki{n}, {dim}\n  %ko{n} = add i64 "
                         f"%kr{n}, {c * 16}\n  %kp{n} = getelementptr {key_type}, ptr {keys}, i64 %ko{n}\n"
                         + _load(f"kf{n}", f"%kp{n}", 4 if keys == "%wide" else itemsize) +
                         f"  %s{n} = call {VECTOR} {FMA}({VECTOR} %qv{c}, {VECTOR} %kf{n}, {VECTOR} {total})\n")
            total = f"%s{n}"
        return steps, total

    sums = [key_sum(key) for key in range(16)]
    names = [name for _, name in sums]
    if depth_first:  # each key's sums, then added into the tree at once: a few vectors live (AVX2's 16 registers)
        reduce, total = add_down(names, VECTOR, "fadd", "t", codes=["".join(steps) for steps, _ in sums])
    else:  # chunk by chunk over the 16 keys, then the tree: 16 sums live (AVX-512's 32 registers)
        text += "".join(steps[c] for c in range(dim // 16) for steps, _ in sums)
        reduce, total = add_down(names, VECTOR, "fadd", "t")
    text += reduce
    return text + ("  %oo = mul i64 %r, %width\n  %oj = add i64 %oo, %kb\n"
                   "  %op = getelementptr float, ptr %out, i64 %oj\n"
                   f"  store {VECTOR} {total}, ptr %op, align 4\n  %r.next = add i64 %r, 1\n"
                   "  %rd = icmp eq i64 %r.next, %rows\n  br i1 %rd, label %next, label %row\nnext:\n"
                   "  %b.next = add i64 %b, 1\n  %bd = icmp eq i64 %b.next, %blocks\n"
                   "  br i1 %bd, label %exit, label %block\nexit:\n  ret void\n}\n")


def _quarter(name: str, part: int, element: str) -> str:
    """%{name}_{part} = lanes 16 part .. 16 part + 15 of the 64-lane vector %{name} of `element`s."""
    return (f"  %{name}_{part} = shufflevector <64 x {element}> %{name}, <64 x {element}> poison, "
            f"<16 x i32> <{lanes(range(16 * part, 16 * part + 16))}>\n")


def scores_q8_ir(dim: int, isa: str = "vnni") -> str:
    """@scores1(q, rows, k, count, out, width) for q8 caches: out[r * width + j] = (q[r] . k[j]) for query rows r
    rounded to 8 bits (q: per row dim int8, its float32 scale, then 128 x the sum of its integers as an int32) and
    keys j < count (a multiple of 16) of a q8 cache, stored plus 128 (unsigned, as vpdpbusd takes them) with their
    scale. One vpdpbusd forms 64 products of a key and a row in 16 integer lanes: the sums are exact, then
    (sum - 128 sum(q)) x q's scale x the key's scale in float32. dim a multiple of 64.
    avx2: the same sums on AVX2, which has no vpdpbusd: each 16 of a key's bytes widened to 16 bits (vpmovzxbw) and
    multiplied with the row's (widened once a row) in vpmaddwd, pairs of products added into 8 integer lanes (at most
    2 x 255 x 127: exact, where vpmaddubsw's 16-bit pairs would saturate); two such halves make a key's 16 lanes, each
    key's added into the tree at once (depth first: AVX2's 16 registers). Integer sums are exact in any order, so
    the scores have the VNNI tile's bits.
    isa "sdot" (ARM64's dot-product extension): each key's bytes less 128 (signed, as sdot takes them) times the
    row's, 16 by 16 into four 32-bit lanes; a key's four lanes added down to its sum. Less 128 already, the sum
    needs no 128 x sum(q) taken off: the same exact integers, the same bits."""
    avx2, sdot = isa == "avx2", isa == "sdot"
    row, stride, chunks = dim + 8, dim + 4, dim // 64
    text = ("define void @scores1(ptr noalias %q, i64 %rows, ptr noalias %k, i64 %count, ptr noalias %out, "
            "i64 %width) {\nentry:\n  %blocks = udiv i64 %count, 16\n  %none = icmp eq i64 %blocks, 0\n"
            "  br i1 %none, label %exit, label %block\nblock:\n  %b = phi i64 [ 0, %entry ], [ %b.next, %next ]\n"
            f"  %kb = mul i64 %b, 16\n  %kbo = mul i64 %kb, {stride}\n  %kbp = getelementptr i8, ptr %k, i64 %kbo\n"
            f"  %ks.0 = insertelement {VECTOR} poison, float 0.0, i64 0\n")
    scales = "%ks.0"
    for key in range(16):  # the 16 keys' scales, once for all the rows
        text += (f"  %ksp{key} = getelementptr i8, ptr %kbp, i64 {key * stride + dim}\n"
                 f"  %kss{key} = load float, ptr %ksp{key}, align 1\n"
                 f"  %ks{key + 1} = insertelement {VECTOR} {scales}, float %kss{key}, i64 {key}\n")
        scales = f"%ks{key + 1}"
    text += f"  br label %row\nrow:\n  %r = phi i64 [ 0, %block ], [ %r.next, %row ]\n  %qo = mul i64 %r, {row}\n"
    text += "  %qp = getelementptr i8, ptr %q, i64 %qo\n"
    for c in range(chunks):
        text += (f"  %qcp{c} = getelementptr i8, ptr %qp, i64 {64 * c}\n"
                 f"  %qv{c} = load <64 x i8>, ptr %qcp{c}, align 1\n")
        if sdot:
            text += "".join(_quarter(f"qv{c}", part, "i8") for part in range(4))
        if avx2:
            text += f"  %qw{c} = sext <64 x i8> %qv{c} to <64 x i16>\n" + "".join(
                _quarter(f"qw{c}", part, "i16") for part in range(4))
    text += (f"  %qsp = getelementptr i8, ptr %qp, i64 {dim}\n  %qs = load float, ptr %qsp, align 1\n"
             f"  %qs.v = insertelement {VECTOR} poison, float %qs, i64 0\n"
             f"  %qs.s = shufflevector {VECTOR} %qs.v, {VECTOR} poison, <16 x i32> zeroinitializer\n"
             f"  %qcp = getelementptr i8, ptr %qp, i64 {dim + 4}\n  %qc = load i32, ptr %qcp, align 1\n"
             "  %qc.v = insertelement <16 x i32> poison, i32 %qc, i64 0\n"
             "  %qc.s = shufflevector <16 x i32> %qc.v, <16 x i32> poison, <16 x i32> zeroinitializer\n")
    sums, codes = [], []
    for key in range(16):
        acc, code = "zeroinitializer", ""
        for c in range(chunks):
            n = f"{key}_{c}"
            code += (f"  %kp{n} = getelementptr i8, ptr %kbp, i64 {key * stride + 64 * c}\n"
                     f"  %kv{n} = load <64 x i8>, ptr %kp{n}, align 1\n")
            if sdot:  # the stored bytes less 128: signed
                code += f"  %kx{n} = xor <64 x i8> %kv{n}, splat (i8 -128)\n"
                for part in range(4):
                    code += (_quarter(f"kx{n}", part, "i8") +
                             f"  %d{n}_{part} = call <4 x i32> @llvm.aarch64.neon.sdot.v4i32.v16i8(<4 x i32> {acc}, "
                             f"<16 x i8> %kx{n}_{part}, <16 x i8> %qv{c}_{part})\n")
                    acc = f"%d{n}_{part}"
            elif avx2:
                code += f"  %kw{n} = zext <64 x i8> %kv{n} to <64 x i16>\n"
                for part in range(4):
                    code += (_quarter(f"kw{n}", part, "i16") +
                             f"  %m{n}_{part} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %kw{n}_{part}, "
                             f"<16 x i16> %qw{c}_{part})\n")
                code += (f"  %lo{n} = add <8 x i32> %m{n}_0, %m{n}_2\n  %hi{n} = add <8 x i32> %m{n}_1, %m{n}_3\n"
                         f"  %e{n} = shufflevector <8 x i32> %lo{n}, <8 x i32> %hi{n}, "
                         f"<16 x i32> <{lanes(range(16))}>\n"
                         f"  %d{n} = add <16 x i32> {acc}, %e{n}\n")
            else:
                code += (f"  %d{n} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {acc}, "
                         f"<64 x i8> %kv{n}, <64 x i8> %qv{c})\n")
            if not sdot:
                acc = f"%d{n}"
        sums.append(acc)
        codes.append(code)
    if sdot:  # each key's four lanes added down into its lane of the 16 keys' sums
        total = "poison"
        for key, (acc, code) in enumerate(zip(sums, codes)):
            text += (code + f"  %sum{key} = call i32 @llvm.vector.reduce.add.v4i32(<4 x i32> {acc})\n"
                     f"  %keys{key} = insertelement <16 x i32> {total}, i32 %sum{key}, i64 {key}\n")
            total = f"%keys{key}"
        reduce = ""
    elif avx2:  # each key's sums formed just before the tree takes them
        reduce, total = add_down(sums, "<16 x i32>", "add", "t", codes=codes)
    else:
        text += "".join(codes)
        reduce, total = add_down(sums, "<16 x i32>", "add", "t")
    text += reduce
    offset = "zeroinitializer" if sdot else "%qc.s"  # (sdot's keys are less 128 already)
    return text + (f"  %exact = sub <16 x i32> {total}, {offset}\n  %sf = sitofp <16 x i32> %exact to {VECTOR}\n"
                   f"  %sc = fmul {VECTOR} {scales}, %qs.s\n  %sv = fmul {VECTOR} %sf, %sc\n"
                   "  %oo = mul i64 %r, %width\n  %oj = add i64 %oo, %kb\n"
                   "  %op = getelementptr float, ptr %out, i64 %oj\n"
                   f"  store {VECTOR} %sv, ptr %op, align 4\n  %r.next = add i64 %r, 1\n"
                   "  %rd = icmp eq i64 %r.next, %rows\n  br i1 %rd, label %next, label %row\nnext:\n"
                   "  %b.next = add i64 %b, 1\n  %bd = icmp eq i64 %b.next, %blocks\n"
                   "  br i1 %bd, label %exit, label %block\nexit:\n  ret void\n}\n")


def values_ir(dim: int, rows: int, itemsize: int, parts: int = 1) -> str:
    """@values{itemsize}_{rows}(w, width, v, count, out, more): out[r] = sum_j w[r * width + j] v[j] for `rows` rows
    and j < count, in order of j (v [count, dim] of the cache's elements, for q8 each row's integers and scale; out
    [rows, dim] float32). With `more` not 0 the sums go on from out's: two calls over keys 0..n and n..count (from
    two caches: attention.py's shared prefixes) add exactly what one call over 0..count adds, in the same order.
    With `parts` > 1 the dimensions are summed in that many parts, each over all the keys in a loop of its own
    (_values_part): each element's sum is the same FMAs in the same order, with fewer sums live at once."""
    name = f"values{itemsize}_{rows}"
    if parts == 1:
        return _values_part(name, "", dim, rows, itemsize, 0, dim)
    span = dim // parts
    calls = "".join(f"  call void @{name}.p{part}(ptr %w, i64 %width, ptr %v, i64 %count, ptr %out, i64 %more)\n"
                    for part in range(parts))
    return ("".join(_values_part(f"{name}.p{part}", "internal ", dim, rows, itemsize, part * span, span)
                    for part in range(parts))
            + f"define void @{name}(ptr noalias %w, i64 %width, ptr noalias %v, i64 %count, ptr noalias %out, "
            f"i64 %more) {{\nentry:\n{calls}  ret void\n}}\n")


def _values_part(name: str, linkage: str, dim: int, rows: int, itemsize: int, first: int, span: int) -> str:
    """values_ir's @name over dimensions first..first + span (a multiple of 16) of each row."""
    scalar, _ = ELEMENTS[itemsize]
    chunks = span // 16
    text = (f"define {linkage}void @{name}(ptr noalias %w, i64 %width, ptr noalias %v, i64 %count, "
            f"ptr noalias %out.row, i64 %more) {{\nentry:\n"
            f"  %out = getelementptr float, ptr %out.row, i64 {first}\n" + initial_sums(rows, chunks, dim, "%more")
            + "  %none = icmp eq i64 %count, 0\n"
            "  br i1 %none, label %store, label %loop\nloop:\n  %j = phi i64 [ 0, %entry ], [ %j.next, %loop ]\n")
    text += running_sums(rows, chunks, "%loop", "i")
    text += f"  %vo = mul i64 %j, {row_bytes(dim, itemsize) // itemsize}\n"
    if itemsize == 1:
        text += "  %vrow = getelementptr i8, ptr %v, i64 %vo\n" + _scale("vs", "%vrow", dim)
    for c in range(chunks):
        text += (f"  %vo{c} = add i64 %vo, {first + c * 16}\n  %vp{c} = getelementptr {scalar}, ptr %v, i64 %vo{c}\n"
                 + _load(f"vf{c}", f"%vp{c}", itemsize, "%vs"))
    for r in range(rows):
        text += (f"  %wr{r} = mul i64 %width, {r}\n  %wo{r} = add i64 %wr{r}, %j\n"
                 f"  %wp{r} = getelementptr float, ptr %w, i64 %wo{r}\n  %ws{r} = load float, ptr %wp{r}, align 4\n"
                 f"  %wv{r}.1 = insertelement {VECTOR} poison, float %ws{r}, i64 0\n"
                 f"  %wv{r} = shufflevector {VECTOR} %wv{r}.1, {VECTOR} poison, <16 x i32> zeroinitializer\n")
        for c in range(chunks):
            text += f"  %a{r}_{c}.next = call {VECTOR} {FMA}({VECTOR} %wv{r}, {VECTOR} %vf{c}, {VECTOR} %a{r}_{c})\n"
    text += ("  %j.next = add i64 %j, 1\n  %done = icmp eq i64 %j.next, %count\n"
             "  br i1 %done, label %store, label %loop\nstore:\n")
    return text + stored_sums(rows, chunks, dim, "%loop", "i")


def q8_instruction_set() -> str | None:
    """The integer dot products the q8 cache's scores run in on this CPU: "vnni" (vpdpbusd) where present, else
    "avx2" (vpmaddwd), "sdot" on ARM64 with the dot-product extension, or None (--cache-type q8 is then refused
    with a line naming what is missing)."""
    for isa, kernel in (("vnni", "q8 cache attention, vnni"), ("avx2", "q8 cache attention"),
                        ("sdot", "q8 cache attention, sdot")):
        if capabilities.available(kernel):
            return isa
    return None


@functools.cache
def kernels(dim: int) -> np.ndarray:
    """The addresses of @scores, @softmax and @values_1..GROUP for head size `dim`, compiled for this CPU:
    row 0 for float32 caches, row 1 for float16 ones, and for head sizes that are a multiple of 64 on CPUs with
    AVX2 or AVX512-VNNI row 2 for q8 ones (the softmax is the same in every row)."""
    q8 = q8_instruction_set() if dim % 64 == 0 else None  # heads a multiple of 64
    wide = capabilities.host_has("avx512f")
    text, names = source(dim, q8, GROUP, depth_first=not wide, wide=wide)
    kernel = {None: "cache attention", "avx2": "q8 cache attention", "vnni": "q8 cache attention, vnni",
              "sdot": "q8 cache attention, sdot"}[q8]
    addresses = compile_ir(text, names, kernel)
    tiles = addresses[:-1].reshape(-1, 1 + GROUP)
    return np.insert(tiles, 1, addresses[-1], axis=1)


def source(dim: int, q8: str | None, most: int = GROUP, depth_first: bool = False,
           wide: bool = True) -> tuple[str, list[str]]:
    """The IR module of the tiles for head size `dim` (with the q8 cache's in instruction set q8, "vnni" or "avx2",
    when given), their values tiles for 1..`most` rows (in value_parts' parts for a CPU with AVX-512's registers or
    without: `wide`), their scores tiles' sums added down depth first or not (scores_ir), and the softmax (last),
    and their names."""
    if dim % 16:
        raise ValueError(f"the attention tiles need a head size that is a multiple of 16, not {dim}")
    sizes = (4, 2, 1) if q8 else (4, 2)
    declaration = {None: "",
                   "vnni": "declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <64 x i8>, <64 x i8>)\n",
                   "avx2": "declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)\n",
                   "sdot": "declare <4 x i32> @llvm.aarch64.neon.sdot.v4i32.v16i8(<4 x i32>, <16 x i8>, <16 x i8>)\n"
                           "declare i32 @llvm.vector.reduce.add.v4i32(<4 x i32>)\n"}[q8]
    text = (DECLARATIONS + declaration
            + "".join((scores_ir(dim, size, depth_first) if size > 1 else scores_q8_ir(dim, q8))
                      + "".join(values_ir(dim, rows, size, value_parts(dim, rows, wide)) for rows in range(1, most + 1))
                      for size in sizes)
            + softmax_ir("softmax", bfloat16=False))
    names = [f"{kind}{size}{suffix}" for size in sizes
             for kind, suffix in [("scores", "")] + [("values", f"_{rows}") for rows in range(1, most + 1)]]
    return text, names + ["softmax"]
