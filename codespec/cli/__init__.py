"""The `codespec` command line: options.py (the parser and the settings built from it), commands.py (what each
command runs, and `main`), types.py (argument types and option groups shared with `codespec bench`)."""

import os
import sys


def main(argv: list[str] | None = None) -> int:
    """The `codespec` entry point (imported lazily: importing the package loads no command)."""
    from .commands import main as run

    return run(argv)


def console() -> None:
    """The `codespec` command: `main`, and a one-shot `generate` then ends its process as soon as its output is
    flushed. The interpreter's teardown (collecting and freeing torch's, numba's and LLVM's objects) took 0.8 s
    of a 4 s `codespec generate` after the text was out; nothing is left to write by then (caches and kept
    copies are written, and renamed into place, during the load)."""
    from . import memory

    memory.OWN_PROCESS = True  # (memory.lifelong_heap)
    code = main()
    if sys.argv[1:2] == ["generate"]:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can reach it
                pass
        os._exit(code)
    sys.exit(code)
