"""codespec: a coding-assistant backend built on lossless self-speculative decoding."""

__version__ = "0.1.0"

import os as _os
import sys as _sys

if _os.environ.get("CODESPEC_CPU", "").lower() == "avx2":  # numba's own loops for the same CPU as the IR tiles
    _os.environ.setdefault("NUMBA_CPU_NAME", "haswell")
    _os.environ.setdefault("NUMBA_CPU_FEATURES", "")  # a Haswell's own features, not this CPU's: the same cached
    # code on every CPU that runs CODESPEC_CPU=avx2 (an emulated Haswell loads what this one compiled)


def _numba_cache_dir() -> str:
    """Where numba keeps its compiled kernels: a folder named by a digest of every module that uses numba. numba
    checks a cached function against its own file only, and a kernel that calls one of another file (layers.py's
    loop inlines attention.py's) kept calling the old one after that file changed: a crash on the next forward."""
    import hashlib
    from pathlib import Path

    package = Path(__file__).parent
    digest = hashlib.sha256()
    for module in sorted(package.rglob("*.py")):
        source = module.read_bytes()
        if b"numba" in source:
            digest.update(module.relative_to(package).as_posix().encode() + b"\0" + source)
    name = f"numba-{digest.hexdigest()[:16]}"
    folder = package / "__pycache__"
    if not _os.access(folder if folder.exists() else package, _os.W_OK):  # (an installed, read-only package)
        home = _os.environ.get("CODESPEC_HOME") or _os.path.join(_os.path.expanduser("~"), ".cache", "codespec")
        folder = Path(home) / "numba"
    return str(folder / name)


_os.environ.setdefault("NUMBA_CACHE_DIR", _numba_cache_dir())
if "numba" in _sys.modules:  # imported first (a script, a notebook): numba read its settings without
    # that folder, and a stale kernel from its default place next to the sources crashed the first forward
    from numba.core import config as _numba_config

    _numba_config.reload_config()
