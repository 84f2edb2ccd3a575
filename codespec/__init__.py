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


UNUSED_DAYS = 7  # another version's compiled kernels are removed once no process has used them for this long


def _tidy_numba_cache(path: str, days: float = UNUSED_DAYS) -> None:
    """Every version of codespec (every edit of a module that uses numba) compiles its kernels into a folder of its
    own (~10 MB), and nothing removed the old ones: a checkout that was edited for a few weeks held ~90 (737 MB). Each
    start marks its own folder as used; the first start of a new version removes the other versions' folders beside
    it that no start has used for `days` (one still in use elsewhere, in a shared cache, just compiles again)."""
    import shutil
    import time
    from pathlib import Path

    folder = Path(path)
    try:
        if folder.is_dir():
            _os.utime(folder)
            return
        cutoff = time.time() - days * 86400
        for other in folder.parent.glob("numba-*"):
            if other != folder and other.is_dir() and other.stat().st_mtime < cutoff:
                shutil.rmtree(other, ignore_errors=True)
    except OSError:  # (a cache we may not write: nothing to tidy)
        pass


_os.environ.setdefault("NUMBA_CACHE_DIR", _numba_cache_dir())
_tidy_numba_cache(_os.environ["NUMBA_CACHE_DIR"])
if "numba" in _sys.modules:  # imported first (a script, a notebook): numba read its settings without
    # that folder, and a stale kernel from its default place next to the sources crashed the first forward
    from numba.core import config as _numba_config

    _numba_config.reload_config()
