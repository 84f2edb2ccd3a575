"""The `codespec` command line: options.py (the parser and the settings built from it), commands.py (what each
command runs, and `main`), types.py (argument types and option groups shared with `codespec bench`)."""


def main(argv: list[str] | None = None) -> int:
    """The `codespec` entry point (imported lazily: importing the package loads no command)."""
    from .commands import main as run

    return run(argv)
