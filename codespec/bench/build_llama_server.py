"""Build llama.cpp's ``llama-server`` and ``llama-quantize`` (CPU, Release) for ``codespec bench --llama-server``
and for requantizing GGUFs into the types people download (Q8_0, Q4_K_M, ...).

For people who lack a binary: the ``llama-cpp-python`` source distribution on PyPI vendors llama.cpp, so this
needs PyPI, a C/C++ compiler and CMake (plus Ninja if present) — no GitHub::

    python -m codespec.bench.build_llama_server --out ~/llama-build

It downloads the pinned sdist with ``pip download --no-deps --no-binary :all:``, unpacks it, configures
``vendor/llama.cpp`` (Release, CPU only, static, no HTTPS, no web UI, no tests/examples), builds only the
``llama-server`` and ``llama-quantize`` targets with one job per core, and prints llama-server's path
(``llama-quantize`` lies beside it). If ``cmake`` (or ``ninja``) is
not on PATH it is pip-installed into this Python's environment first, and the script says so.

Pinned: llama-cpp-python 0.3.36, whose vendored llama.cpp's ``llama-server`` has ``--spec-type`` with
``ngram-simple``, ``ngram-map-k``, ``ngram-map-k4v``, ``ngram-mod``, ``ngram-cache`` and draft models (see
``codespec/bench/llama_server.py`` for the types and defaults found in its ``common/``). Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",      # one self-contained binary
    "-DGGML_NATIVE=ON",             # tuned for this CPU (the binary is for this machine)
    "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
    "-DLLAMA_OPENSSL=OFF",          # no HTTPS model downloads (LLAMA_CURL is deprecated and ignored here)
    "-DLLAMA_BUILD_UI=OFF",         # no npm build of the web UI
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # and no download of a prebuilt one (offline builds)
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
]
# --cpu avx2: the build an AVX2-only CPU (most laptops, AMD before Zen 4) runs, on any x86 host, for the side-by-side
# against `CODESPEC_CPU=avx2` (docs/benchmarks.md): ggml's x86 paths picked by hand instead of -march=native
AVX2_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
              "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
              "-DGGML_AMX_BF16=OFF"]
CPUS = {"native": [], "avx2": AVX2_FLAGS}


def _say(msg: str) -> None:
    print(f"[build-llama-server] {msg}", flush=True)


def _tool(name: str) -> str | None:
    """Path of ``name`` on PATH or next to this Python (a venv's bin/)."""
    here = Path(sys.executable).parent / name
    return shutil.which(name) or (str(here) if here.exists() else None)


def ensure_build_tools() -> tuple[str, str | None]:
    """(cmake, ninja or None); pip-installs what is missing into this environment."""
    cmake, ninja = _tool("cmake"), _tool("ninja")
    missing = [n for n, p in (("cmake", cmake), ("ninja", ninja)) if p is None]
    if missing:
        _say(f"{' and '.join(missing)} not found on PATH: pip-installing {' '.join(missing)} into {sys.prefix}")
        subprocess.run([sys.executable, "-m", "pip", "install", *missing], check=True)
        cmake, ninja = _tool("cmake"), _tool("ninja")
    if cmake is None:
        raise SystemExit("build-llama-server: cmake is still missing after pip install cmake")
    return cmake, ninja


def download_sdist(dest: Path, version: str) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        _say(f"downloading the llama-cpp-python=={version} source distribution from PyPI")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(dest)], check=True)
        found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        raise SystemExit(f"build-llama-server: pip did not leave llama_cpp_python-{version}.tar.gz in {dest}")
    return found[0]


def unpack(sdist: Path, dest: Path) -> Path:
    root = dest / sdist.name[: -len(".tar.gz")]
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        _say(f"unpacking {sdist.name}")
        with tarfile.open(sdist) as tar:
            if hasattr(tarfile, "data_filter"):  # Python 3.12+, and 3.8-3.11 security releases
                tar.extractall(dest, filter="data")
            else:
                tar.extractall(dest)
    src = root / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        raise SystemExit(f"build-llama-server: no vendored llama.cpp in {root}")
    return src


def build(out: Path, version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None, cpu: str = "native") -> Path:
    """cpu: "native" (this machine's CPU, in build/) or "avx2" (AVX2 and nothing newer, in build-avx2/)."""
    out = out.expanduser().resolve()
    cmake, ninja = ensure_build_tools()
    src = unpack(download_sdist(out, version), out)
    bdir = out / ("build" if cpu == "native" else f"build-{cpu}")
    jobs = jobs or os.cpu_count() or 1
    gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    t0 = time.monotonic()
    _say(f"configuring {src} (Release, CPU only, {cpu}) in {bdir}")
    flags = [flag for flag in CMAKE_FLAGS if not (CPUS[cpu] and flag.startswith("-DGGML_NATIVE"))] + CPUS[cpu]
    subprocess.run([cmake, "-S", str(src), "-B", str(bdir), *gen, *flags], check=True)
    _say(f"building llama-server and llama-quantize with {jobs} jobs (takes a while on few cores)")
    subprocess.run([cmake, "--build", str(bdir), "--target", "llama-server", "llama-quantize", "-j", str(jobs)],
                   check=True)
    binary = bdir / "bin" / "llama-server"
    for built in (binary, quantizer(binary)):
        if not built.exists():
            raise SystemExit(f"build-llama-server: build finished but {built} is missing")
    _say(f"built in {time.monotonic() - t0:.0f} s")
    return binary


def quantizer(server: Path) -> Path:
    """llama-quantize, built beside `server` (llama-server's path)."""
    return Path(server).parent / "llama-quantize"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codespec.bench.build_llama_server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="work directory (sdist, sources, build/)")
    ap.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python version (sdist)")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel jobs (default: all cores)")
    ap.add_argument("--cpu", choices=sorted(CPUS), default="native",
                    help="native: tuned for this CPU (build/); avx2: AVX2 and nothing newer, as an AVX2-only laptop "
                         "runs it, whatever this CPU has (build-avx2/)")
    a = ap.parse_args(argv)
    binary = build(a.out, a.version, a.jobs, a.cpu)
    print(binary)
    prefix = "CODESPEC_CPU=avx2 " if a.cpu == "avx2" else ""
    _say(f"run: {prefix}codespec bench --llama-server {binary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
