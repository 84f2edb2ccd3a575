"""Every LLVM IR module codespec compiles, compiled for CPUs this machine may not be: nothing runs, so these hold
on any x86 host. The portable tiles must compile for an AVX2-only CPU (x86-64-v3, "haswell") without a 512-bit
instruction (LLVM aborts the whole process on an AVX-512 intrinsic for such a target: `codespec generate` did, on
AVX2 machines, until exp_ir stopped using vscalefps). The AVX-512 tiles compile for Zen 4 and use the instructions
they exist for; on a CPU without those, asking for them is a Python error, never an abort."""

import pytest

from codespec.forward.kernels import attention_ir, llvmir, prompt_attention, q8, quantized

AVX2 = "haswell"
AVX512 = "znver4"  # AVX512-VNNI and AVX512-BF16


def no_512_bit_registers(assembly: str) -> bool:
    return "zmm" not in assembly and "{k" not in assembly  # no 512-bit vectors, no mask registers


@pytest.mark.parametrize("module", ["silu", "attention", "Q4_1", "Q8_0"])
def test_the_portable_tiles_compile_for_an_avx2_cpu_without_avx512(module):
    if module == "silu":
        source = llvmir.SILU_IR
    elif module == "attention":
        source, _ = attention_ir.source(64, q8=False)
    else:
        source, _ = quantized.source(module)
    assembly = llvmir.assembly(source, AVX2)
    assert "vfmadd" in assembly and "ymm" in assembly  # 256-bit FMAs: the tiles' 16 lanes as two halves
    assert no_512_bit_registers(assembly)


def test_the_avx512_tiles_compile_for_zen4_with_their_instructions():
    assert "vpdpbusd" in llvmir.assembly(q8.source("Q4_1")[0], AVX512)
    assert "vpdpbusd" in llvmir.assembly(attention_ir.source(64, q8=True)[0], AVX512)
    assembly = llvmir.assembly(prompt_attention.source(64), AVX512)
    assert "vdpbf16ps" in assembly and "vscalef" not in assembly  # exp_ir's 2^n from exponent bits, anywhere


def test_asking_for_instructions_this_cpu_lacks_is_an_error_not_an_abort():
    with pytest.raises(llvmir.MissingInstructions, match="no-such-feature"):
        llvmir.compile_ir("define void @f() {\n  ret void\n}\n", ["f"], needs=("no-such-feature",))
    assert q8.available() == llvmir.host_has("avx512vnni")
    assert prompt_attention.available() == llvmir.host_has("avx512bf16")
    rows = attention_ir.kernels(64).shape[0]
    assert rows == (3 if llvmir.host_has("avx512vnni") else 2)  # the q8 cache's tiles only where they run


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_the_float_tiles_for_avx2_keep_their_sums_in_registers(kind):
    """AVX2 has 16 vector registers, and each row's sums take four: its tiles take two rows (quantized.tile_rows), and
    their loops touch the stack only for the three arguments passed there (N, out, r). A 4-row tile spills."""
    def stack_accesses(rows_each):
        assembly = llvmir.assembly(quantized.source(kind, rows_each)[0], AVX2)
        return [body.split(".Lfunc_end")[0].count("(%rsp)") for body in assembly.split(f"{kind.lower()}_")[1:]
                if ":" in body.split("\n")[0]]
    assert max(stack_accesses(quantized.tile_rows(wide_registers=False))) <= 3
    assert max(stack_accesses([4])) > 3
