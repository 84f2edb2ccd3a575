"""macOS and Linux on ARM64, as far as code can tell on this Linux x86 host: every call that only Linux (or glibc,
or x86) has runs behind a guard with a fallback, and each guard is run here with the missing piece forced
missing. What each fallback gives up is in its docstring."""

import builtins
import ctypes
import os
import sys
from pathlib import Path

import pytest

from codespec.bench import llama_server, zoo
from codespec.cli import memory
from codespec.forward import models
from codespec.forward.kernels import capabilities


class NoMallopt:  # macOS's libc (and musl's): no mallopt
    pass


def test_without_glibcs_mallopt_nothing_is_tuned_and_nothing_fails(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv(memory.ENVIRONMENT, raising=False)
    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: NoMallopt())
    assert memory.return_freed_memory() == 0
    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: (_ for _ in ()).throw(OSError("no libc")))
    assert memory.return_freed_memory() == 0


def without_proc(monkeypatch):
    """open() and Path.read_text() of anything under /proc fail, as on macOS."""
    opened, read = builtins.open, Path.read_text

    def open_(file, *args, **kwargs):
        if str(file).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory", str(file))
        return opened(file, *args, **kwargs)

    def read_text(path, *args, **kwargs):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return read(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(Path, "read_text", read_text)


def test_without_proc_the_memory_checks_pass_and_the_zoo_reports_no_peak(monkeypatch, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert models.available_memory() is not None  # (Linux: the check reads /proc/meminfo)
    without_proc(monkeypatch)
    assert models.available_memory() is None
    models.check_direct_memory(gguf)  # no figure to refuse on: the load goes on
    assert zoo._peak_rss(os.getpid()) is None


def test_peak_rss_is_in_bytes_on_linux_and_on_macos(monkeypatch):
    linux = zoo.peak_rss_self()
    assert 50e6 < linux < 100e9  # KiB times 1,024
    monkeypatch.setattr(sys, "platform", "darwin")  # macOS gives ru_maxrss in bytes already
    assert zoo.peak_rss_self() * 1024 == linux


def test_without_fcntl_the_conversion_lock_holds_nothing_and_lets_the_load_go_on(monkeypatch, tmp_path):
    imported = builtins.__import__

    def import_(name, *args, **kwargs):
        if name == "fcntl":
            raise ImportError("No module named 'fcntl'")
        return imported(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", import_)
    with models.conversion_lock(tmp_path):
        entered = True
    assert entered and not (tmp_path / ".pull.lock").exists()


def test_without_prctl_a_bench_server_is_started_all_the_same(monkeypatch):
    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: (_ for _ in ()).throw(OSError("libc.so.6")))
    assert llama_server._die_with_parent() is None
    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: NoMallopt())  # a libc without prctl
    assert llama_server._die_with_parent() is None


@pytest.fixture
def fresh_capabilities():
    cached = (capabilities.host_features, capabilities.host_has, capabilities.available)
    for function in cached:
        function.cache_clear()
    yield
    for function in cached:
        function.cache_clear()


def test_a_cpu_whose_features_llvmlite_cannot_tell_runs_no_tile(monkeypatch, fresh_capabilities):
    """llvmlite without a host feature query for this CPU: no IR tile is compiled (the PyTorch path runs, and the
    start line says so), and asking for one is a Python error, never an LLVM abort."""
    import llvmlite.binding as llvm

    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: (_ for _ in ()).throw(RuntimeError("unknown")))
    assert capabilities.host_features() == {}
    for kernel, needs in capabilities.NEEDS.items():
        assert capabilities.available(kernel) == all(feature == "openmp" and capabilities.host_has("openmp")
                                                     for feature in needs)
    with pytest.raises(capabilities.MissingInstructions, match="avx2"):
        capabilities.check("q8 block tiles")


def test_an_arm64_cpus_features_leave_only_the_portable_tiles(monkeypatch, fresh_capabilities):
    """An Apple M1 as llvmlite reports it: the q8 and bfloat16 tiles (x86 intrinsics) are not available, the
    portable ones are."""
    import llvmlite.binding as llvm

    monkeypatch.setattr(llvm, "get_host_cpu_features",
                        lambda: {"neon": True, "dotprod": True, "i8mm": True, "fp-armv8": True, "avx2": False})
    for kernel in ("q8 block tiles", "q8 block tiles, vnni", "q8 cache attention", "q8 cache attention, vnni",
                   "prompt attention", "four-row block tiles"):
        assert not capabilities.available(kernel)
    assert capabilities.available("silu") and capabilities.available("float block tiles")
    assert capabilities.available("q8 cache attention, sdot") == capabilities.host_has("openmp")  # the dot product
