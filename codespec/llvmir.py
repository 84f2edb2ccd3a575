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
