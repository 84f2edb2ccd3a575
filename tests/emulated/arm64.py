"""The portable kernels on an emulated ARM64 CPU (issue 39; `.ci/qemu-arm64` drives it).

On ARM64 codespec runs the IR modules that are plain IR (capabilities.NEEDS: no x86 feature): the float block
tiles for every GGUF type, the attention tiles for float32 and float16 caches, SiLU; and the q8 tiles in ARM64's
sdot (the dot-product extension) and in its smmla (the int8 matrix multiply, i8mm), every type's blocks times rows
rounded to 8 bits; and the q8 cache's scores in sdot (exact integer sums: the x86 tiles' float32 bits, exactly).
This lane has two halves:

- `prepare DIR` (natively, in the project's environment): writes each module's IR text exactly as codespec builds
  it for a CPU with 16 vector registers (ARM64's NEON has 32 of 128 bits: a 16-lane vector takes four, as AVX2's
  take two of 256), with random inputs, each GGUF type's blocks (the K-quants from tests/kquants.py's encoder) and
  float64 references built from gguf.quants.dequantize;
- `run DIR` (under `qemu-aarch64`, with only numpy and llvmlite: PyPI's ARM64 torch is a CUDA build): compiles the
  same IR with ARM64's LLVM for the emulated CPU, calls each function as codespec's kernels do, and checks every
  output against the float64 reference within the bounds of the x86 unit tests (tests/unit/test_block_tiles.py,
  test_attention.py), and that a row gets the same bits alone or in a tile of two.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np

TILE_ROWS = [2, 1]  # block_tiles.tile_rows(wide_registers=False)
TOLERANCE = 1e-5  # relative to the largest output, as the x86 unit tests
DIM = 64  # a head's size (the default model's)


def prepare(folder: Path) -> None:
    from gguf import GGMLQuantizationType as Type, quants

    from codespec.forward.kernels import attention_tiles, block_tiles, layers, q8_tiles
    from tests.gguf_files import quantize
    from tests.unit.test_q8_cache import q8_rows

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    cases = []
    for kind in (Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.Q4_K, Type.Q5_K, Type.Q6_K):
        weight = rng.standard_normal((40, 512)).astype(np.float32)
        raw = quantize(weight, kind)
        reference = quants.dequantize(raw, kind).astype(np.float64)
        tensor = type("Tensor", (), {"name": "t", "tensor_type": kind, "data": raw})
        blocks = block_tiles.Blocks.read(tensor)
        text, names = block_tiles.source(blocks.kind, TILE_ROWS)
        x = rng.standard_normal((5, 512)).astype(np.float32)
        np.savez(folder / f"{kind.name}.npz", x=x, q=blocks.q, d=blocks.d, m=blocks.m,
                 expected=x.astype(np.float64) @ reference.T)
        (folder / f"{kind.name}.ll").write_text(text)
        cases.append({"kind": "blocks", "name": kind.name, "functions": names})
        # the same blocks in the q8 tiles for ARM64's sdot, times the rows rounded to 8 bits (rounded8: run
        # natively), against the float64 product of the rounded rows and the blocks' values
        # (and in smmla, two rows at a time, where the CPU has the int8 matrix multiply: the same packed blocks)
        q8, held, form, columns, _ = blocks.q8_packed("neon")
        xq, xd, xs, xh = q8_tiles.rounded8(x, q8_tiles.rounder())
        rounded = xq.astype(np.float64) * np.repeat(xd, 32, axis=1)
        np.savez(folder / f"q8-{kind.name}.npz", x=xq, q=q8, s=held, xd=xd, xs=xs, xh=xh,
                 expected=rounded @ reference.T)
        for isa, needs in (("neon", "+dotprod"), ("i8mm", "+dotprod,+i8mm")):
            text, names = q8_tiles.source(form, isa)
            (folder / f"q8-{kind.name}-{isa}.ll").write_text(text)
            cases.append({"kind": "q8", "name": f"q8-{kind.name}", "isa": isa, "needs": needs, "functions": names,
                          "columns": columns, "form": form.name})
    text, names = attention_tiles.source(DIM, q8=None, depth_first=True, wide=False)
    (folder / "attention.ll").write_text(text)
    count = 48  # keys, a multiple of 16
    q = rng.standard_normal((3, DIM)).astype(np.float32)
    keys = rng.standard_normal((count, DIM)).astype(np.float32)
    values = rng.standard_normal((count, DIM)).astype(np.float32)
    weights = rng.random((3, count)).astype(np.float32)
    for itemsize, dtype in ((4, np.float32), (2, np.float16)):
        k, v = keys.astype(dtype), values.astype(dtype)
        np.savez(folder / f"attention{itemsize}.npz", q=q, k=k, v=v, w=weights,
                 scores=q.astype(np.float64) @ k.astype(np.float64).T, sums=weights.astype(np.float64) @ v.astype(
                     np.float64))
    logits = (rng.standard_normal((3, count)) * 4).astype(np.float32)
    valid = np.array([5, 16, 37])  # a partial block alone, one whole block, whole blocks and a partial one
    expected = np.zeros((3, count))
    for r, n in enumerate(valid):
        e = np.exp(logits[r, :n].astype(np.float64) - logits[r, :n].max())
        expected[r, :n] = e / e.sum()
    np.savez(folder / "softmax.npz", logits=logits, valid=valid, expected=expected)
    cases.append({"kind": "attention", "name": "attention", "functions": names})
    # the q8 cache's scores in sdot: exact integer sums times the scales in float32, bit for bit the x86 tiles' values
    text, names = attention_tiles.source(DIM, q8="sdot", most=1, depth_first=True)
    (folder / "q8-attention.ll").write_text(text)
    keys, queries = rng.integers(-127, 128, (count, DIM)), rng.integers(-127, 128, (3, DIM))
    keys[0], keys[1], queries[0], queries[1] = 127, -127, 127, -127  # the extremes in every lane
    key_scales, query_scales = (rng.uniform(0.01, 2, n).astype(np.float32) for n in (count, 3))
    exact = (queries @ keys.T).astype(np.float32)  # (exact in int64, then exactly representable)
    np.savez(folder / "q8-attention.npz", k=q8_rows(keys, key_scales, True), q=q8_rows(queries, query_scales, False),
             expected=exact * (key_scales[None, :] * query_scales[:, None]))
    cases.append({"kind": "q8 attention", "name": "q8 attention", "functions": names, "needs": "+dotprod"})
    (folder / "silu.ll").write_text(layers.SILU_IR)
    gate = rng.standard_normal((2, 64)).astype(np.float32) * 4
    np.savez(folder / "silu.npz", gate=gate, expected=(gate[0] / (1 + np.exp(-gate[0].astype(np.float64)))) * gate[1])
    cases.append({"kind": "silu", "name": "silu", "functions": ["silu_mul"]})
    (folder / "cases.json").write_text(json.dumps(cases))


# Debian's ARM64 Python and what it and llvmlite load, unpacked into a folder (qemu-aarch64 -L): never installed
SYSROOT_PACKAGES = ("python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 zlib1g libexpat1 libffi8 "
                    "libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libgcc-s1 libstdc++6 libncursesw6 libtinfo6 libreadline8 "
                    "libuuid1 libcrypt1 libnsl2 libtirpc3 libdb5.3 libgdbm6 libgssapi-krb5-2 libkrb5-3 libk5crypto3 "
                    "libcom-err2 libkrb5support0 libkeyutils1").split()
ARM64_WHEELS = ("numpy", "llvmlite")  # all the run half imports: at this environment's versions, for aarch64


def setup(folder: Path) -> tuple[Path, Path]:
    """(sysroot, site): an ARM64 Python unpacked from Debian's arm64 packages (apt-get download: the arm64
    architecture is added to dpkg's list, as root) and aarch64 wheels of numpy and llvmlite at this environment's
    versions (pip install --target --platform), in `folder`; kept for the next run."""
    import importlib.metadata
    import os
    import subprocess

    sysroot, site = folder / "sysroot", folder / "site"
    python = sysroot / "usr" / "bin" / "python3.11"
    if not python.exists():
        debs = folder / "debs"
        debs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        architectures = subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True, text=True)
        if "arm64" not in architectures.stdout.split():
            subprocess.run(["dpkg", "--add-architecture", "arm64"], check=True)
            subprocess.run(["apt-get", "update"], check=True, capture_output=True, env=env)
        subprocess.run(["apt-get", "download", *(f"{package}:arm64" for package in SYSROOT_PACKAGES)], check=True,
                       cwd=debs, capture_output=True, env=env)
        for deb in sorted(debs.glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(sysroot)], check=True)
    if not (site / "llvmlite").exists():
        platforms = [a for tag in ("manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux_2_17_aarch64",
                                   "manylinux2014_aarch64") for a in ("--platform", tag)]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(site), *platforms,
                        "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--no-deps",
                        *(f"{name}=={importlib.metadata.version(name)}" for name in ARM64_WHEELS)],
                       check=True, capture_output=True)
    return python, site


CPUS = (None, "neoverse-n1", "apple-m1")  # LLVM's own pick for the emulated CPU, a Linux server's, a Mac's


def compiled(text: str, names: list[str], needs: str = "") -> list[int]:
    """The functions `names` of IR `text` compiled for compiled.cpu (None: the emulated CPU as LLVM detects it,
    plus `needs`, the features the module needs: qemu's CPU has them, LLVM may not see them through qemu-user; a
    named CPU without them, an Apple M1's without i8mm, is given them, as qemu's "max" CPU runs them)."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    cpu = compiled.cpu or llvm.get_host_cpu_name()
    features = needs if compiled.cpu else ",".join(f for f in (llvm.get_host_cpu_features().flatten(), needs) if f)
    machine = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=features, opt=3)
    module = llvm.parse_assembly(text)
    module.verify()
    passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    passes.getModulePassManager().run(module, passes)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    compiled.engines.append(engine)  # (the code lives as long as its engine)
    return [engine.get_function_address(name) for name in names]


compiled.engines, compiled.cpu = [], None
P, I = ctypes.c_void_p, ctypes.c_int64


def address(array: np.ndarray) -> int:
    return array.ctypes.data


def check(name: str, got: np.ndarray, expected: np.ndarray) -> float:
    error = float(np.abs(got - expected).max() / np.abs(expected).max())
    if not error < TOLERANCE:
        raise AssertionError(f"{name}: relative error {error:.2e} (bound {TOLERANCE:.0e})")
    return error


def run_blocks(folder: Path, case: dict) -> str:
    data = np.load(folder / f"{case['name']}.npz")
    x, q, d, m = (np.ascontiguousarray(data[a]) for a in "xqdm")
    tiles = [ctypes.CFUNCTYPE(None, P, I, P, P, P, I, I, P, I)(a)
             for a in compiled((folder / f"{case['name']}.ll").read_text(), case["functions"])]
    rows, size = x.shape
    columns = q.shape[0]

    def product(first: int, count: int) -> np.ndarray:  # rows first.. in tiles of two, then one (block_tiles.linear)
        out = np.zeros((rows, columns), np.float32)
        r = first
        while r < first + count:
            t = 0 if first + count - r >= TILE_ROWS[0] else 1
            for n in range(columns):
                tiles[t](address(x), size, address(q), address(d), address(m), n, columns, address(out), r)
            r += TILE_ROWS[t]
        return out[first : first + count]

    together = product(0, rows)
    alone = np.concatenate([product(r, 1) for r in range(rows)])
    if not np.array_equal(alone, together):
        raise AssertionError(f"{case['name']}: a row alone and in a tile of two differ")
    return f"{case['name']}: {check(case['name'], together, data['expected']):.1e}"


def run_q8(folder: Path, case: dict) -> str:
    """The q8 tiles in sdot: rows in tiles of up to four (q8_tiles.linear), then each row alone, the same bits."""
    data = np.load(folder / f"{case['name']}.npz")
    x, q, s, xd, xs, xh = (np.ascontiguousarray(data[a]) for a in ("x", "q", "s", "xd", "xs", "xh"))
    tiles = [ctypes.CFUNCTYPE(None, P, I, P, P, I, P, I, I, P, P, P)(a) for a in compiled(
        (folder / f"{case['name']}-{case['isa']}.ll").read_text(), case["functions"], case["needs"])]
    rows, size = x.shape
    groups = q.shape[0]

    def product(first: int, count: int) -> np.ndarray:
        out = np.zeros((rows, groups * 16), np.float32)
        r = first
        while r < first + count:
            take = min(len(tiles), first + count - r)
            for g in range(groups):
                tiles[take - 1](address(x), size, address(q), address(s), g, address(out), groups * 16, r,
                                address(xd), address(xs), address(xh))
            r += take
        return out[first : first + count, : case["columns"]]

    together = product(0, rows)
    alone = np.concatenate([product(r, 1) for r in range(rows)])
    if not np.array_equal(alone, together):
        raise AssertionError(f"{case['name']}: a row alone and in a tile of four differ")
    return f"{case['name']} ({case['form']}, {case['isa']}): {check(case['name'], together, data['expected']):.1e}"


def run_attention(folder: Path, case: dict) -> list[str]:
    addresses = compiled((folder / "attention.ll").read_text(), case["functions"])
    per_kind = (len(addresses) - 1) // 2  # (float32's scores and values, then float16's, then the softmax)
    results = []
    for index, itemsize in enumerate((4, 2)):
        data = np.load(folder / f"attention{itemsize}.npz")
        q, k, v, w = (np.ascontiguousarray(data[a]) for a in ("q", "k", "v", "w"))
        rows, count = w.shape
        scores_tile = ctypes.CFUNCTYPE(None, P, I, P, I, P, I)(addresses[index * per_kind])
        values_tile = ctypes.CFUNCTYPE(None, P, I, P, I, P, I)(addresses[index * per_kind + 1])
        scores = np.zeros((rows, count), np.float32)
        scores_tile(address(q), rows, address(k), count, address(scores), count)
        one = np.zeros((1, count), np.float32)
        scores_tile(address(q[1:2].copy()), 1, address(k), count, address(one), count)
        if not np.array_equal(one[0], scores[1]):
            raise AssertionError(f"attention scores, {itemsize}-byte cache: a row alone and among three differ")
        sums = np.zeros((rows, DIM), np.float32)
        for r in range(rows):
            values_tile(address(w[r:].copy()), count, address(v), count, address(sums[r:]), 0)
        every_row = ctypes.CFUNCTYPE(None, P, I, P, I, P, I)(addresses[index * per_kind + rows])  # values_{rows}
        together = np.zeros((rows, DIM), np.float32)
        every_row(address(w), count, address(v), count, address(together), 0)
        if not np.array_equal(together, sums):
            raise AssertionError(f"attention values, {itemsize}-byte cache: a row alone and among three differ")
        results.append(f"scores{itemsize}: {check('scores', scores, data['scores']):.1e}")
        results.append(f"values{itemsize}: {check('values', sums, data['sums']):.1e}")
    data = np.load(folder / "softmax.npz")
    logits, expected = np.ascontiguousarray(data["logits"]), data["expected"]
    softmax_tile = ctypes.CFUNCTYPE(None, P, I, P, I, P, I)(addresses[-1])
    weights = np.full(logits.shape, np.nan, np.float32)
    for r, n in enumerate(data["valid"]):
        softmax_tile(address(logits[r:]), int(n), address(weights[r:]), logits.shape[1], 0, 0)
    results.append(f"softmax: {check('softmax', weights, expected):.1e}")
    return results


def run_q8_attention(folder: Path, case: dict) -> str:
    """The q8 cache's scores tile in sdot: the expected float32 bits exactly, a row alone as among three."""
    addresses = compiled((folder / "q8-attention.ll").read_text(), case["functions"], case["needs"])
    data = np.load(folder / "q8-attention.npz")
    q, k, expected = np.ascontiguousarray(data["q"]), np.ascontiguousarray(data["k"]), data["expected"]
    scores_tile = ctypes.CFUNCTYPE(None, P, I, P, I, P, I)(addresses[case["functions"].index("scores1")])
    rows, count = expected.shape
    scores = np.zeros((rows, count), np.float32)
    scores_tile(address(q), rows, address(k), count, address(scores), count)
    one = np.zeros((1, count), np.float32)
    scores_tile(address(q[1:2].copy()), 1, address(k), count, address(one), count)
    if not np.array_equal(scores.view(np.int32), expected.view(np.int32)) or not np.array_equal(one[0], scores[1]):
        raise AssertionError("q8 attention scores in sdot: not the exact integer sums' float32 bits")
    return "q8 scores (sdot): the same bits"


def run_silu(folder: Path, case: dict) -> str:
    data = np.load(folder / "silu.npz")
    gate = np.ascontiguousarray(data["gate"]).reshape(-1)
    silu = ctypes.CFUNCTYPE(None, P, I)(compiled((folder / "silu.ll").read_text(), case["functions"])[0])
    silu(address(gate), 64)
    return f"silu: {check('silu', gate[:64], data['expected']):.1e}"


def run(folder: Path) -> None:
    import platform

    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    for cpu in CPUS:
        compiled.cpu = cpu
        print(f"{platform.machine()}, compiled for {cpu or 'this CPU: ' + llvm.get_host_cpu_name()}; relative error "
              f"against float64 (bound {TOLERANCE:.0e}):")
        results = []
        for case in json.loads((folder / "cases.json").read_text()):
            if case["kind"] == "blocks":
                results.append(run_blocks(folder, case))
            elif case["kind"] == "q8":
                results.append(run_q8(folder, case))
            elif case["kind"] == "attention":
                results += run_attention(folder, case)
            elif case["kind"] == "q8 attention":
                results.append(run_q8_attention(folder, case))
            else:
                results.append(run_silu(folder, case))
        print("  " + ", ".join(results))
    print("every portable kernel matches its float64 reference, and a row gets the same bits alone or in a tile")


if __name__ == "__main__":
    {"prepare": prepare, "run": run}[sys.argv[1]](Path(sys.argv[2]))
