"""LLVM IR compiled for this CPU by llvmlite (the LLVM that numba ships as a wheel: no compiler to install): the
tiles of quantized.py (GGUF blocks) and attention_ir.py (attention against the cache) are written this way, with
explicit 16-lane vectors where numba's own loops vectorise poorly."""

from __future__ import annotations

import numpy as np

_ENGINES = []  # compiled code lives as long as its engine


def compile_ir(source: str, names: list[str]) -> np.ndarray:
    """Compile `source` (an LLVM IR module) at -O3 for this CPU's features; the addresses of its functions `names`."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
    module = llvm.parse_assembly(source)
    module.verify()
    passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    passes.getModulePassManager().run(module, passes)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    _ENGINES.append(engine)
    return np.array([engine.get_function_address(name) for name in names], dtype=np.int64)


def splat(name: str, pointer: str, vector: str, scalar: str) -> str:
    """%name = the `scalar` at `pointer` in every lane of `vector` (16 lanes)."""
    return (f"  %{name}.s = load {scalar}, ptr {pointer}, align 4\n"
            f"  %{name}.v = insertelement {vector} poison, {scalar} %{name}.s, i64 0\n"
            f"  %{name} = shufflevector {vector} %{name}.v, {vector} poison, <16 x i32> zeroinitializer\n")


def _exp_ir(out: str, x: str) -> str:
    """%out = exp(%x) for 16 floats, as Cephes' expf computes it (2^n times a degree-7 polynomial, within about
    one unit in the last place): LLVM has no vector exp of its own (numba's loop calls expf once per element)."""
    v = "<16 x float>"
    text = (f"  %{out}.c = call {v} @llvm.maxnum.v16f32({v} {x}, {v} splat (float -88.0))\n"
            f"  %{out}.x = call {v} @llvm.minnum.v16f32({v} %{out}.c, {v} splat (float 88.0))\n"
            f"  %{out}.t = fmul {v} %{out}.x, splat (float 0x3FF7154760000000)\n"  # log2(e)
            f"  %{out}.h = fadd {v} %{out}.t, splat (float 0.5)\n"
            f"  %{out}.n = call {v} @llvm.floor.v16f32({v} %{out}.h)\n"
            f"  %{out}.a = fmul {v} %{out}.n, splat (float 0x3FE6300000000000)\n"  # ln 2 = 0.693359375
            f"  %{out}.r1 = fsub {v} %{out}.x, %{out}.a\n"
            f"  %{out}.b = fmul {v} %{out}.n, splat (float 0xBF2BD01060000000)\n"  # ... - 2.12194440e-4
            f"  %{out}.r = fsub {v} %{out}.r1, %{out}.b\n  %{out}.z = fmul {v} %{out}.r, %{out}.r\n")
    terms = ["0x3F2A0D2CE0000000", "0x3F56E879C0000000", "0x3F81112100000000", "0x3FA5553820000000",
             "0x3FC5555540000000", "0x3FE0000000000000"]  # 1.9875691500E-4 .. 5.0000001201E-1
    previous = f"splat (float {terms[0]})"
    for i, term in enumerate(terms[1:]):
        text += (f"  %{out}.p{i} = fmul {v} {previous}, %{out}.r\n"
                 f"  %{out}.q{i} = fadd {v} %{out}.p{i}, splat (float {term})\n")
        previous = f"%{out}.q{i}"
    text += (f"  %{out}.y1 = fmul {v} {previous}, %{out}.z\n  %{out}.y2 = fadd {v} %{out}.y1, %{out}.r\n"
             f"  %{out}.y = fadd {v} %{out}.y2, splat (float 1.0)\n"
             f"  %{out}.i = fptosi {v} %{out}.n to <16 x i32>\n"
             f"  %{out}.e = add <16 x i32> %{out}.i, splat (i32 127)\n"
             f"  %{out}.s = shl <16 x i32> %{out}.e, splat (i32 23)\n"
             f"  %{out}.p = bitcast <16 x i32> %{out}.s to {v}\n  %{out} = fmul {v} %{out}.y, %{out}.p\n")
    return text


SILU_IR = ("declare <16 x float> @llvm.maxnum.v16f32(<16 x float>, <16 x float>)\n"
           "declare <16 x float> @llvm.minnum.v16f32(<16 x float>, <16 x float>)\n"
           "declare <16 x float> @llvm.floor.v16f32(<16 x float>)\n"
           "define void @silu_mul(ptr noalias %gate, i64 %inner) {\nentry:\n  br label %loop\nloop:\n"
           "  %i = phi i64 [ 0, %entry ], [ %i.next, %loop ]\n"
           "  %gp = getelementptr float, ptr %gate, i64 %i\n  %g = load <16 x float>, ptr %gp, align 4\n"
           "  %ui = add i64 %i, %inner\n  %up = getelementptr float, ptr %gate, i64 %ui\n"
           "  %u = load <16 x float>, ptr %up, align 4\n  %m = fneg <16 x float> %g\n"
           + _exp_ir("e", "%m") +
           "  %d = fadd <16 x float> %e, splat (float 1.0)\n  %s = fdiv <16 x float> %g, %d\n"
           "  %o = fmul <16 x float> %s, %u\n  store <16 x float> %o, ptr %gp, align 4\n"
           "  %i.next = add i64 %i, 16\n  %done = icmp uge i64 %i.next, %inner\n"
           "  br i1 %done, label %end, label %loop\nend:\n  ret void\n}\n")


def silu_mul() -> int:
    """The address of @silu_mul(gate, inner): gate[i] = silu(gate[i]) * gate[inner + i] for i < inner (a multiple
    of 16), 16 at a time: the MLP's gate times up, in place over one row of the fused gate/up projection."""
    global _SILU
    if _SILU is None:
        _SILU = int(compile_ir(SILU_IR, ["silu_mul"])[0])
    return _SILU


_SILU = None
