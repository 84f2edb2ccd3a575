"""CPUs this machine is not, emulated by Debian's qemu-user (issue 39): an ARM64 CPU runs the portable kernels
against their float64 reference (tests/emulated/arm64.py), and an AVX2-only Haswell runs the default model's AVX2
path, where an AVX-512 instruction would be a SIGILL. What it needs and installs when missing (as root): Debian's
qemu-user; for ARM64, Debian's arm64 Python unpacked into a folder and aarch64 wheels of numpy and llvmlite."""

import os
import subprocess
from pathlib import Path

from tests.emulated import arm64
from tests.integration.test_vscode_real import install_debian_packages

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "codespec-emulated"


def test_the_portable_kernels_match_their_float64_reference_on_an_emulated_arm64_cpu(tmp_path):
    install_debian_packages(["qemu-user"])
    python, site = arm64.setup(CACHE / "arm64")
    arm64.prepare(tmp_path)  # (natively: the IR text, the inputs and the references)
    done = subprocess.run(["qemu-aarch64", "-L", str(CACHE / "arm64" / "sysroot"), str(python),
                           str(Path(arm64.__file__)), "run", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(site)})
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("aarch64, compiled for") == len(arm64.CPUS)
    assert "every portable kernel matches its float64 reference" in done.stdout
