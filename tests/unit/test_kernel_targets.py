"""Every LLVM IR module codespec compiles, compiled for CPUs this machine may not be: nothing runs, so these hold
on any x86 host. The portable tiles must compile for an AVX2-only CPU (x86-64-v3, "haswell") without a 512-bit
instruction (LLVM aborts the whole process on an AVX-512 intrinsic for such a target: `codespec generate` did, on
AVX2 machines, until exp_ir stopped using vscalefps). The AVX-512 tiles compile for Zen 4 and use the instructions
they exist for; on a CPU without those, asking for them is a Python error, never an abort."""

from pathlib import Path

import pytest

from codespec.forward.kernels import attention_tiles, block_tiles, capabilities, layers, native, prompt_attention
from codespec.forward.kernels import q8_tiles

AVX2 = "haswell"
AVX512 = "znver4"  # AVX512-VNNI and AVX512-BF16
HASWELL = {"avx", "avx2", "fma", "f16c", "bmi2", "openmp"}  # what an AVX2 laptop has (and numba's pool)
FORMS = [q8_tiles.Form(True), q8_tiles.Form(True, wide=True), q8_tiles.Form(False, minimum=False),
              q8_tiles.Form(False, 1, True, True), q8_tiles.Form(False, 2, False, True), q8_tiles.Form(False, 2, True, True),
              q8_tiles.Form(True, factored=True), q8_tiles.Form(False, 2, False, factored=True),
              q8_tiles.Form(False, 1, True, factored=True)]  # (factored: K-quants' scales as bytes times a base)
# every LLVM IR module codespec compiles, by its entry in the capability table
MODULES = {
    "silu": lambda: layers.SILU_IR,
    "cache attention": lambda: attention_tiles.source(64, q8=None)[0] + attention_tiles.source(  # and AVX2's
        64, q8=None, depth_first=True, wide=False)[0].removeprefix(
        attention_tiles.DECLARATIONS).replace("@scores", "@avx2_scores").replace("@values", "@avx2_values").replace(
        "@softmax", "@avx2_softmax"),
    "q8 cache attention": lambda: attention_tiles.source(64, q8="avx2", most=1, depth_first=True)[0],
    "q8 cache attention, vnni": lambda: attention_tiles.source(64, q8="vnni")[0],
    "q8 cache attention, sdot": lambda: attention_tiles.source(64, q8="sdot", most=1, depth_first=True)[0],
    "float block tiles": lambda: block_tiles.FMA_DECLARATION + "".join(  # every layout's
        block_tiles.source(kind, block_tiles.tile_rows(False))[0].split("\n", 1)[1] for kind in block_tiles.KINDS),
    "four-row block tiles": lambda: block_tiles.source("Q4_1", [4, 3])[0],
    "q8 block tiles": lambda: every_form("avx2"),
    "q8 block tiles, vnni": lambda: every_form("vnni"),
    "q8 block tiles, neon": lambda: every_form("neon"),
    "q8 block tiles, i8mm": lambda: every_form("i8mm"),
    "prompt attention": lambda: prompt_attention.source(64),
}


PLANE_FORMS = [q8_tiles.Form(True, 1, True, False, 1, 16), q8_tiles.Form(True, 1, True, True, 1),
               q8_tiles.Form(True, 2, True, True, 2, 32), q8_tiles.Form(True, offset=8),
               q8_tiles.Form(True, 1, True, False, 1, factored=True),
               q8_tiles.Form(True, 2, True, False, 2, 32, True)]  # nibbles and planes of higher bits (Q5_*, Q6_K); formed minimums
VNNI_FORMS = PLANE_FORMS + [q8_tiles.Form(False, offset=128)]  # (bytes' m = -128 d: vpdpbusd reads them unsigned)


def every_form(isa: str) -> str:
    """The q8 tiles of instruction set `isa` for every form they hold blocks in, one module."""
    prelude = q8_tiles.DECLARATIONS[isa] + q8_tiles.ROUND_DECLARATIONS + q8_tiles.ROUND_IR  # (@round8 once)
    return prelude + "".join(
        q8_tiles.source(form, isa)[0].removeprefix(prelude)
        for form in FORMS + {"vnni": VNNI_FORMS, "avx2": PLANE_FORMS}.get(isa, [q8_tiles.Form(True, offset=8)]))


def no_512_bit_registers(assembly: str) -> bool:
    return "zmm" not in assembly and "{k" not in assembly  # no 512-bit vectors, no mask registers


def test_every_ir_module_is_in_the_capability_table():
    assert set(MODULES) == set(capabilities.NEEDS) - {"layers"}  # (layers: numba's own loops, no IR of their own)


@pytest.mark.parametrize("kernel", sorted(MODULES))
def test_every_ir_module_compiles_for_an_avx2_cpu_or_the_table_keeps_it_off(kernel):
    """What the table allows on an AVX2 CPU compiles for one, without a 512-bit instruction; what it does not allow
    is never handed to LLVM there (that aborts the process; test_asking_for_instructions_this_cpu_lacks_is_an_error_
    not_an_abort), and compiles for a CPU that has what the table names."""
    if capabilities.missing(kernel, have=HASWELL):
        if not capabilities.missing(kernel, ARM64_FEATURES):  # ARM64's (test_the_portable_modules_compile_for_arm64)
            return
        assert no_512_bit_registers(native.assembly(MODULES[kernel](), AVX512)) is False  # it is AVX-512 code
        return
    assembly = native.assembly(MODULES[kernel](), AVX2)
    assert "vfmadd" in assembly and "ymm" in assembly  # 256-bit FMAs: the tiles' 16 lanes as two halves
    assert no_512_bit_registers(assembly)


def test_the_avx512_tiles_compile_for_zen4_with_their_instructions():
    assert "vpdpbusd" in native.assembly(every_form("vnni"), AVX512)
    assert "vpdpbusd" in native.assembly(attention_tiles.source(64, q8="vnni")[0], AVX512)
    assembly = native.assembly(prompt_attention.source(64), AVX512)
    assert "vdpbf16ps" in assembly and "vscalef" not in assembly  # exp_ir's 2^n from exponent bits, anywhere


def test_asking_for_instructions_this_cpu_lacks_is_an_error_not_an_abort():
    capabilities.NEEDS["test"] = ("no-such-feature",)
    try:
        with pytest.raises(capabilities.MissingInstructions, match="no-such-feature"):
            native.compile_ir("define void @f() {\n  ret void\n}\n", ["f"], "test")
    finally:
        del capabilities.NEEDS["test"]
    assert q8_tiles.available() == capabilities.host_has("avx2")
    assert q8_tiles.instruction_set() == ("vnni" if capabilities.host_has("avx512vnni") else
                                          "avx2" if capabilities.host_has("avx2") else None)
    assert prompt_attention.available() == capabilities.host_has("avx512bf16")
    assert attention_tiles.kernels(64).shape[1] == 2 + attention_tiles.GROUP
    rows = attention_tiles.kernels(64).shape[0]
    assert rows == (3 if capabilities.host_has("avx2") else 2)  # the q8 cache's tiles only where they run
    assert attention_tiles.q8_instruction_set() == ("vnni" if capabilities.host_has("avx512vnni") else
                                                    "avx2" if capabilities.host_has("avx2") else None)
    assert list(block_tiles.ROWS) == ([4, 3, 2, 1] if capabilities.host_has("avx512f") else [2, 1])


def test_the_q8_cache_scores_for_avx2_form_their_integer_sums_in_vpmaddwd():
    """The q8 cache's scores on AVX2: each key's bytes widened to 16 bits and multiplied in vpmaddwd (vpmaddubsw's
    16-bit pairs would saturate on a key's unsigned bytes), never a 512-bit register."""
    assembly = native.assembly(attention_tiles.source(64, q8="avx2", most=1, depth_first=True)[0], AVX2)
    assert "vpmaddwd" in assembly and "vpmovzxbw" in assembly and no_512_bit_registers(assembly)
    assert "vpmaddubsw" not in assembly and "vpdpbusd" not in assembly


@pytest.mark.parametrize("form", FORMS, ids=lambda form: form.name)
def test_the_q8_tiles_for_avx2_form_their_integer_sums_in_vpmaddubsw(form):
    """AVX2 has no vpdpbusd: unsigned bytes times signed bytes in vpmaddubsw, widened by vpmaddwd; signed bytes
    through their magnitudes and vpsignb (q8_tiles._avx2_sums), never a 512-bit register."""
    assembly = native.assembly(q8_tiles.source(form, "avx2")[0], AVX2)
    assert "vpmaddubsw" in assembly and "vpmaddwd" in assembly and no_512_bit_registers(assembly)
    assert ("vpsignb" in assembly) == (not form.nibbles)


def test_an_arm64_cpu_runs_the_smmla_tiles_with_i8mm_the_sdot_tiles_with_the_dot_product_else_float32(monkeypatch):
    """The instruction set comes from the capability table: an ARM64 CPU's features pick the smmla tiles where it has
    the int8 matrix multiply (i8mm), else the sdot tiles (dotprod; q8 activations, the default there too), one
    without them float32 activations, never an x86 tile."""
    from codespec.forward import plan

    capabilities.available.cache_clear()
    monkeypatch.setattr(capabilities, "host_has", lambda feature: feature in ARM64_FEATURES)
    try:
        assert q8_tiles.instruction_set() == "i8mm" and q8_tiles.available()
        assert plan.q8_activations("auto", Path("model.gguf"))
        capabilities.available.cache_clear()
        monkeypatch.setattr(capabilities, "host_has", lambda feature: feature in ARM64_FEATURES - {"i8mm"})
        assert q8_tiles.instruction_set() == "neon"
        capabilities.available.cache_clear()
        monkeypatch.setattr(capabilities, "host_has", lambda feature: feature in ARM64_FEATURES - {"dotprod"})
        assert q8_tiles.instruction_set() is None and not plan.q8_activations("auto", Path("model.gguf"))
    finally:
        capabilities.available.cache_clear()


def test_codespec_cpu_avx2_runs_the_avx2_kernels_on_a_higher_cpu(monkeypatch):
    """CODESPEC_CPU=avx2 turns AVX-512 (and AVX-VNNI, AMX) off in the capability table and in the features the IR is
    compiled for, so the AVX2 kernels run, and are measured, on an AVX-512 machine; an unknown value is one line."""
    from codespec.errors import CodespecError

    def fresh():
        for cached in (capabilities.host_features, capabilities.host_has, capabilities.available):
            cached.cache_clear()
    try:
        monkeypatch.setenv("CODESPEC_CPU", "avx2")
        fresh()
        assert not any(have for name, have in capabilities.host_features().items() if name.startswith("avx512"))
        assert q8_tiles.instruction_set() == ("avx2" if capabilities.host_has("avx2") else None)
        machine = native.target_machine()  # this CPU's, as the tiles are compiled: no 512-bit register
        assert no_512_bit_registers(machine.emit_assembly(native.optimised(MODULES["float block tiles"](), machine)))
        monkeypatch.setenv("CODESPEC_CPU", "pentium")
        fresh()
        with pytest.raises(CodespecError, match="CODESPEC_CPU=pentium: use one of native, avx2"):
            capabilities.host_features()
    finally:
        monkeypatch.delenv("CODESPEC_CPU")
        fresh()


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "Q8_M", "Q8_16"])
def test_the_float_tiles_for_avx2_keep_their_sums_in_registers(kind):
    """AVX2 has 16 vector registers, and each row's sums take four: its tiles take two rows (block_tiles.tile_rows), and
    their loops touch the stack only for the three arguments passed there (N, out, r). A 4-row tile spills."""
    def stack_accesses(rows_each):
        assembly = native.assembly(block_tiles.source(kind, rows_each)[0], AVX2)
        return [body.split(".Lfunc_end")[0].count("(%rsp)") for body in assembly.split(f"{kind.lower()}_")[1:]
                if ":" in body.split("\n")[0]]
    assert max(stack_accesses(block_tiles.tile_rows(wide_registers=False))) <= 3
    assert max(stack_accesses([4])) > 3


def test_the_attention_tiles_for_avx2_keep_fewer_sums_live_with_the_same_operations():
    """AVX2's 16 vector registers hold one query row's four 16-lane value sums, not four rows': the values tile sums
    16 dimensions of four rows at a time (value_parts), with the stack untouched; and the scores tile adds each key's
    sums into the tree as soon as they are formed (depth first): the same instructions as the tree built level by
    level, in another order, and the stack touched far less (measured on a 2-core AVX2 host, 16 rows over 900
    cached keys: a forward 50 -> 41 ms)."""
    for itemsize in (4, 2):
        level, depth = (attention_tiles.scores_ir(64, itemsize, depth_first) for depth_first in (False, True))
        assert level != depth and sorted(level.splitlines()) == sorted(depth.splitlines())

    def stack(text: str, name: str) -> int:
        assembly = native.assembly(attention_tiles.DECLARATIONS + text, AVX2)
        return assembly.split(f"{name}:")[1].split(".Lfunc_end")[0].count("(%rsp)")

    assert [attention_tiles.value_parts(64, rows, False) for rows in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert attention_tiles.value_parts(64, 4, True) == 1 and attention_tiles.value_parts(128, 1, False) == 2
    for itemsize in (4, 2, 1):
        for rows in range(1 if itemsize > 1 else 2, attention_tiles.GROUP + 1):  # (q8's one row: a few, as before)
            assert native.assembly(attention_tiles.DECLARATIONS + attention_tiles.values_ir(
                64, rows, itemsize, attention_tiles.value_parts(64, rows, False)), AVX2).count("(%rsp)") == 0
        whole = attention_tiles.values_ir(64, attention_tiles.GROUP, itemsize)
        assert stack(whole, f"values{itemsize}_{attention_tiles.GROUP}") > 0
    assert stack(attention_tiles.scores_ir(64, 2, True), "scores2") < 0.85 * stack(
        attention_tiles.scores_ir(64, 2, False), "scores2")


def test_numbas_cache_folder_changes_with_any_module_that_uses_numba(monkeypatch, tmp_path):
    """numba checks a cached function against its own file only: layers.py's loop, which inlines attention.py's
    kernel, kept the old kernel after attention.py changed (a crash). The folder is named by every numba module."""
    import os
    from pathlib import Path

    import codespec

    assert os.environ["NUMBA_CACHE_DIR"] == codespec._numba_cache_dir()
    read = Path.read_bytes

    def edited(path):
        return read(path) + (b"\n# edited" if path.name == "attention.py" else b"")

    monkeypatch.setattr(Path, "read_bytes", edited)
    assert codespec._numba_cache_dir() != os.environ["NUMBA_CACHE_DIR"]
    monkeypatch.setattr(Path, "read_bytes", read)
    monkeypatch.setattr(os, "access", lambda *args: False)  # a read-only install: under $CODESPEC_HOME
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path))
    assert codespec._numba_cache_dir().startswith(str(tmp_path / "numba"))


def test_numba_imported_before_codespec_still_caches_in_codespecs_folder():
    """A script that imports numba first: numba read its settings before codespec named the folder, and the stale
    kernels at numba's default place (beside the sources) crashed the first forward after an update."""
    import subprocess
    import sys

    code = ("import numba, os\nimport codespec\nfrom numba.core import config\n"
            "print(config.CACHE_DIR == os.environ['NUMBA_CACHE_DIR'] == codespec._numba_cache_dir())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if k != "NUMBA_CACHE_DIR"})
    assert run.stdout.strip() == "True", run.stderr[-2000:]


ARM64 = {"apple-m1": "arm64-apple-macosx14.0.0", "neoverse-n1": "aarch64-unknown-linux-gnu"}  # a Mac, a Linux server
ARM64_FEATURES = {"neon", "dotprod", "i8mm", "fp-armv8", "openmp"}  # an Apple M2's or a Graviton 3's, as LLVM names


@pytest.mark.parametrize("cpu", sorted(ARM64))
@pytest.mark.parametrize("kernel", sorted(MODULES))
def test_the_portable_modules_compile_for_arm64_and_the_x86_ones_are_never_asked_for_there(cpu, kernel):
    """The plain-IR modules compile for ARM64 (a Mac's and a Linux server's), their 16-lane sums in NEON's fmla.
    The modules with x86 intrinsics would abort LLVM there: the capability table keeps them from being compiled on
    a CPU with ARM64's features (the PyTorch path, or the portable tiles, run instead, and the start line says so)."""
    if capabilities.missing(kernel, ARM64_FEATURES):
        assert any(feature.startswith("avx") for feature in capabilities.NEEDS[kernel])
        return
    i8mm = kernel == "q8 block tiles, i8mm"  # (an M1 and a Graviton 2 lack it: compiled with it)
    assembly = native.assembly(MODULES[kernel](), cpu, "+i8mm" if i8mm else "", triple=ARM64[cpu])
    assert "fmla" in assembly and "ymm" not in assembly and "xmm" not in assembly
    if i8mm:  # every form's integer sums in smmla, two rows by two columns a time, and no sdot
        assert "smmla" in assembly and "sdot" not in assembly
    if kernel in ("q8 block tiles, neon", "q8 cache attention, sdot"):  # integer sums in sdot, 16 bytes by 16 into 4
        assert "sdot" in assembly  # lanes (Apple's assembly spells it sdot.4s, Linux's sdot v0.4s)


def test_the_first_start_of_a_version_removes_other_versions_kernels_unused_for_a_week(tmp_path):
    """Each version's kernels live in a folder of their own: a start marks its folder as used, and the first start of
    a new version removes the folders beside it that nothing has used for UNUSED_DAYS."""
    import os
    import time

    import codespec

    day = 86400
    old, recent, current = (tmp_path / name for name in ("numba-old", "numba-recent", "numba-current"))
    for folder, age in ((old, 9 * day), (recent, 2 * day)):
        (folder / "kernels").mkdir(parents=True)
        (folder / "kernels" / "f.nbi").write_bytes(b"x")
        os.utime(folder, (time.time() - age, time.time() - age))
    other = tmp_path / "unrelated"
    other.mkdir()
    os.utime(other, (time.time() - 30 * day, time.time() - 30 * day))
    codespec._tidy_numba_cache(str(current))
    assert not old.exists() and recent.exists() and other.exists()
    current.mkdir()
    os.utime(current, (time.time() - 30 * day, time.time() - 30 * day))
    codespec._tidy_numba_cache(str(current))  # a start of the version whose folder this is: marked as used
    assert time.time() - current.stat().st_mtime < 60 and recent.exists()
