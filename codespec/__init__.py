"""codespec: a coding-assistant backend built on lossless self-speculative decoding."""

__version__ = "0.1.0"

import os as _os

if _os.environ.get("CODESPEC_CPU", "").lower() == "avx2":  # numba's own loops for the same CPU as the IR tiles
    _os.environ.setdefault("NUMBA_CPU_NAME", "haswell")
