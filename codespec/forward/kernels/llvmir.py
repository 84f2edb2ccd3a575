"""LLVM IR compiled for this CPU by llvmlite (the LLVM that numba ships as a wheel: no compiler to install): the
tiles of quantized.py (GGUF blocks) and attention_ir.py (attention against the cache) are written this way, with
explicit 16-lane vectors where numba's own loops vectorise poorly."""

from __future__ import annotations

import functools
import struct

import numpy as np

_ENGINES = []  # compiled code lives as long as its engine


@functools.cache
def host_has(feature: str) -> bool:
    """Whether this CPU has `feature` as LLVM names it ("avx512vnni", "avx512bf16", ...): a tile that uses an
    instruction of that set is compiled only where this says so (LLVM aborts the process on an intrinsic its target
    lacks)."""
    try:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        return bool(llvm.get_host_cpu_features().get(feature, False))
    except Exception:  # noqa: BLE001 - no llvmlite, or a target it does not know: the PyTorch paths instead
        return False


class MissingInstructions(RuntimeError):
    """A tile needs instructions this CPU does not have (LLVM would abort the whole process compiling it)."""


def target_machine(cpu: str | None = None, features: str | None = None):
    """An LLVM target machine at -O3: this CPU's (default), or a named one (`cpu`, e.g. "haswell" for x86-64-v3,
    "znver4"; `features` as LLVM spells them) with the default triple, to check that IR compiles for it."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    if cpu is None:
        cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    return llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=features or "", opt=3)


def compile_ir(source: str, names: list[str], needs: tuple[str, ...] = ()) -> np.ndarray:
    """Compile `source` (an LLVM IR module) at -O3 for this CPU's features; the addresses of its functions `names`.
    needs: the CPU features its intrinsics need (MissingInstructions where one is missing, never an abort)."""
    import llvmlite.binding as llvm

    missing = [feature for feature in needs if not host_has(feature)]
    if missing:
        raise MissingInstructions(f"this CPU lacks {', '.join(missing)}, which these kernels need")
    machine = target_machine()
    engine = llvm.create_mcjit_compiler(optimised(source, machine), machine)
    engine.finalize_object()
    _ENGINES.append(engine)
    return np.array([engine.get_function_address(name) for name in names], dtype=np.int64)


def assembly(source: str, cpu: str, features: str = "") -> str:
    """`source` compiled at -O3 for another CPU (nothing runs): its assembly, to check that a tile compiles for a
    target this machine is not and uses the instructions it should."""
    machine = target_machine(cpu, features)
    return machine.emit_assembly(optimised(source, machine))


def optimised(source: str, machine):
    """`source` parsed, verified and run through LLVM's -O3 pipeline for `machine`."""
    import llvmlite.binding as llvm

    module = llvm.parse_assembly(source)
    module.verify()
    passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    passes.getModulePassManager().run(module, passes)
    return module


def splat(name: str, pointer: str, vector: str, scalar: str) -> str:
    """%name = the `scalar` at `pointer` in every lane of `vector` (16 lanes)."""
    return (f"  %{name}.s = load {scalar}, ptr {pointer}, align 4\n"
            f"  %{name}.v = insertelement {vector} poison, {scalar} %{name}.s, i64 0\n"
            f"  %{name} = shufflevector {vector} %{name}.v, {vector} poison, <16 x i32> zeroinitializer\n")


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


SILU_IR = (EXP_DECLARATIONS
           + "define void @silu_mul(ptr noalias %gate, i64 %inner) {\nentry:\n  br label %loop\nloop:\n"
           "  %i = phi i64 [ 0, %entry ], [ %i.next, %loop ]\n"
           "  %gp = getelementptr float, ptr %gate, i64 %i\n  %g = load <16 x float>, ptr %gp, align 4\n"
           "  %ui = add i64 %i, %inner\n  %up = getelementptr float, ptr %gate, i64 %ui\n"
           "  %u = load <16 x float>, ptr %up, align 4\n  %m = fneg <16 x float> %g\n"
           + exp_ir("e", "%m") +
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
