"""LLVM IR compiled for this CPU by llvmlite (the LLVM that numba ships as a wheel: no compiler to install): the
tiles of block_tiles.py (GGUF blocks) and attention_tiles.py (attention against the cache) are written this way, with
explicit 16-lane vectors where numba's own loops vectorise poorly. numba code calls them through `call`.

ir.py holds the vocabulary they are written in; capabilities.py says what each needs."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numpy as np
from numba.core import types
from numba.extending import intrinsic

from . import capabilities

_ENGINES = []  # compiled code lives as long as its engine


def _numba_without_cffi() -> None:
    """numba's support for cffi functions makes a cffi C parser the first time it types anything (pycparser building
    its tables: 0.16 s of every start where cffi is installed, as cryptography brings it). codespec hands numba no cffi
    function, so that support is loaded here, before any kernel is typed, with cffi hidden: numba then has none.
    cffi itself stays importable."""
    if "cffi" in sys.modules or "numba.core.typing.cffi_utils" in sys.modules:
        return
    sys.modules["cffi"] = None  # (an import of it raises ImportError)
    try:
        import numba.core.typing.cffi_utils  # noqa: F401
    finally:
        del sys.modules["cffi"]


_numba_without_cffi()


def target_machine(cpu: str | None = None, features: str | None = None, triple: str | None = None):
    """An LLVM target machine at -O3: this CPU's (default), or a named one (`cpu`, e.g. "haswell" for x86-64-v3,
    "znver4", or with `triple` "aarch64-unknown-linux-gnu" "apple-m1"; `features` as LLVM spells them), to check
    that IR compiles for it."""
    import llvmlite.binding as llvm

    if triple is None:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
    else:
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
    if cpu is None:  # this CPU, less what CODESPEC_CPU turns off
        cpu = llvm.get_host_cpu_name()
        features = ",".join(("+" if have else "-") + name for name, have in capabilities.host_features().items())
    target = llvm.Target.from_default_triple() if triple is None else llvm.Target.from_triple(triple)
    return target.create_target_machine(cpu=cpu, features=features or "", opt=3)


def compile_ir(source: str, names: list[str], kernel: str) -> np.ndarray:
    """Compile `source` (an LLVM IR module) at -O3 for this CPU's features; the addresses of its functions `names`.
    kernel: its entry in the capability table (MissingInstructions where this CPU lacks what it needs, before LLVM
    sees it: never an abort)."""
    import llvmlite.binding as llvm

    capabilities.check(kernel)
    machine = target_machine()
    path = _object_path(source)
    cached = path.read_bytes() if path.is_file() else None
    # a cached object needs no optimising: the module only names the functions (its code comes from the file)
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(source) if cached else optimised(source, machine), machine)
    engine.set_object_cache(lambda module, code: cached or _keep(path, code), lambda module: cached)
    engine.finalize_object()
    _ENGINES.append(engine)
    return np.array([engine.get_function_address(name) for name in names], dtype=np.int64)


def _object_path(source: str) -> Path:
    """Where the machine code of `source` for this CPU (less what CODESPEC_CPU turns off) is kept between processes:
    beside numba's cache (whose folder changes with any module that uses numba, this one included), named by a
    digest of the IR and the CPU. LLVM compiling the tiles took ~0.9 s of every load."""
    import llvmlite
    import llvmlite.binding as llvm

    features = ",".join(sorted(name for name, have in capabilities.host_features().items() if have))
    key = "\0".join((source, llvm.get_host_cpu_name(), features, llvmlite.__version__))
    return Path(os.environ.get("NUMBA_CACHE_DIR") or Path.home() / ".cache" / "codespec" / "numba") / "ir" / (
        hashlib.sha256(key.encode()).hexdigest()[:32] + ".o")


def _keep(path: Path, code: bytes) -> None:
    """Write a compiled object for the next process (atomically; a read-only place keeps nothing)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(code)
        partial.replace(path)
    except OSError:
        pass


def assembly(source: str, cpu: str, features: str = "", triple: str | None = None) -> str:
    """`source` compiled at -O3 for another CPU (nothing runs; `triple`: another architecture): its assembly, to
    check that a tile compiles for a target this machine is not and uses the instructions it should."""
    machine = target_machine(cpu, features, triple)
    return machine.emit_assembly(optimised(source, machine))


def optimised(source: str, machine):
    """`source` parsed, verified and run through LLVM's -O3 pipeline for `machine`."""
    import llvmlite.binding as llvm

    module = llvm.parse_assembly(source)
    module.verify()
    passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    passes.getModulePassManager().run(module, passes)
    return module


@intrinsic
def call(typingctx, address, *args):
    """From numba code: call the native function at `address` with integer arguments (pointers as the integers
    `array.ctypes.data` gives). Every argument goes as an i64: on x86-64 and AArch64 a pointer parameter is passed
    exactly as one, so the tiles keep their `ptr` parameters."""
    from llvmlite import ir

    def codegen(context, builder, signature, values):
        i64 = ir.IntType(64)
        callee = builder.inttoptr(values[0], ir.FunctionType(ir.VoidType(), [i64] * len(args)).as_pointer())
        given = [builder.extract_value(values[1], i) for i in range(len(args))]
        builder.call(callee, [value if value.type == i64 else builder.sext(value, i64) for value in given])
        return context.get_dummy_value()
    return types.void(address, types.StarArgTuple.from_types(args)), codegen
