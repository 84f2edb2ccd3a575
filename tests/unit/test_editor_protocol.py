"""The editor clients against the one protocol schema (lsp/protocol.py): a command id, title, prompt, setting
or notification that a client spells differently fails here, not in an editor."""

import json
import subprocess

import pytest

from lsp.protocol import schema
from tests.editors import NVIM_PLUGIN, PROTOCOL_JSON, VSCODE, apply_text_edits, nvim, user_command_name

CLIENT_ONLY_SETTINGS = {"serverCommand", "serverArgs"}  # the VS Code extension's own, never sent to the server


def test_protocol_json_is_generated_from_the_schema():
    assert json.loads(PROTOCOL_JSON.read_text()) == schema(), \
        "editors/protocol.json is stale: python -m lsp.protocol > editors/protocol.json"


def vscode_manifest():
    return json.loads((VSCODE / "package.json").read_text())


def test_vscode_commands_are_the_schemas():
    contributed = vscode_manifest()["contributes"]["commands"]
    assert contributed == [{"command": c["id"], "title": c["title"]} for c in schema()["commands"]], \
        "cd editors/vscode && npm run update-manifest"


def test_vscode_settings_mirror_the_schemas():
    section = schema()["settingsSection"]
    properties = vscode_manifest()["contributes"]["configuration"]["properties"]
    server = {key.removeprefix(f"{section}."): value for key, value in properties.items()
              if key.removeprefix(f"{section}.") not in CLIENT_ONLY_SETTINGS}
    assert list(server) == [s["name"] for s in schema()["settings"]]
    for setting in schema()["settings"]:
        assert server[setting["name"]]["type"] == setting["type"], setting["name"]
        assert server[setting["name"]]["default"] == setting["default"], setting["name"]
        assert server[setting["name"]]["description"], setting["name"]


def nvim_lua(script: str, tmp_path, version: str = "0.12") -> dict:
    """Runs a Lua chunk in a headless Neovim with the plugin on its runtimepath; returns what it prints as JSON."""
    path = tmp_path / "probe.lua"
    path.write_text(f'vim.opt.rtp:prepend({json.dumps(str(NVIM_PLUGIN))})\n{script}')
    run = subprocess.run([nvim(version), "--headless", "--clean", "-l", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stderr)  # print() in `nvim -l` writes to stderr


@pytest.mark.parametrize("version", ["0.12", "0.11"])
def test_nvim_plugin_commands_and_settings_come_from_the_schema(tmp_path, version):
    probe = nvim_lua("""
        local codespec = require("codespec")
        codespec.setup({ cmd = { "false" } })
        local commands = {}
        for name, command in pairs(vim.api.nvim_get_commands({})) do
          if name:match("^Codespec") then commands[name] = { nargs = command.nargs, desc = command.definition } end
        end
        local settings = {}
        for _, setting in ipairs(codespec.schema.settings) do
          settings[setting.name] = codespec.setting(setting.name)
        end
        print(vim.json.encode({ created = codespec.user_commands, commands = commands, settings = settings,
                                stats_method = codespec.schema.notifications.stats.method }))
    """, tmp_path, version)
    expected = [user_command_name(c["id"]) for c in schema()["commands"]]
    assert probe["created"] == expected
    for command in schema()["commands"]:
        user_command = probe["commands"][user_command_name(command["id"])]
        assert user_command["desc"].startswith(command["title"])
        assert user_command["nargs"] == ("*" if command["prompt"] else "0")
        if command["prompt"]:
            assert command["prompt"].lower() in user_command["desc"]
    assert set(probe["commands"]) == set(expected) | {"CodespecStats"}
    assert probe["settings"] == {s["name"]: s["default"] for s in schema()["settings"]}
    assert probe["stats_method"] == schema()["notifications"]["stats"]["method"]


def test_nvim_plugin_refuses_a_schema_without_the_stats_it_shows(tmp_path):
    broken = schema()
    broken["notifications"]["stats"]["params"].remove("tokens_per_second")
    (tmp_path / "protocol.json").write_text(json.dumps(broken))
    probe = nvim_lua(f"""
        local ok, err = pcall(require("codespec").setup, {{ protocol = {json.dumps(str(tmp_path / "protocol.json"))} }})
        print(vim.json.encode({{ ok = ok, err = err }}))
    """, tmp_path)
    assert probe == {"ok": False, "err": "codespec: the protocol's stats notification lacks tokens_per_second"}


def test_nvim_plugin_warns_about_an_unknown_setting(tmp_path):
    probe = nvim_lua("""
        local warnings = {}
        vim.notify = function(message) table.insert(warnings, message) end
        local codespec = require("codespec")
        codespec.setup({ cmd = { "false" }, settings = { max_tokenz = 3 } })
        local buf = vim.api.nvim_create_buf(true, false)
        vim.api.nvim_buf_set_name(buf, vim.fn.tempname() .. ".py")
        vim.api.nvim_set_current_buf(buf)
        pcall(codespec.start, buf)
        print(vim.json.encode({ warnings = warnings }))
    """, tmp_path)
    assert any('unknown setting "max_tokenz"' in w for w in probe["warnings"]), probe


@pytest.mark.parametrize("edits, expected", [
    ([], "ab\ncd\n"),
    ([{"range": {"start": {"line": 0, "character": 1}, "end": {"line": 1, "character": 1}}, "newText": "X"}],
     "aXd\n"),
    ([{"range": {"start": {"line": 1, "character": 0}, "end": {"line": 1, "character": 0}}, "newText": "1"},
      {"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 2}}, "newText": "zz"}],
     "zz\n1cd\n"),
])
def test_apply_text_edits(edits, expected):
    """The helper the Neovim test checks buffers with."""
    assert apply_text_edits("ab\ncd\n", edits) == expected


def test_the_settings_defaults_are_config_pys_in_the_schema_and_both_editors():
    """A default changed in codespec/config.py reaches the LSP's settings, protocol.json (Neovim reads its defaults
    there) and the VS Code manifest, or this fails."""
    from codespec.config import DEFAULT_MODEL, SpecConfig

    expected = {"model": DEFAULT_MODEL, "spec": list(SpecConfig().spec), "draft_max": SpecConfig().draft_max}
    schema_defaults = {s["name"]: s["default"] for s in json.loads(PROTOCOL_JSON.read_text())["settings"]}
    section = schema()["settingsSection"]
    properties = vscode_manifest()["contributes"]["configuration"]["properties"]
    for name, value in expected.items():
        assert schema_defaults[name] == value, f"editors/protocol.json's {name}: python -m lsp.protocol"
        assert properties[f"{section}.{name}"]["default"] == value, \
            f"package.json's {name}: cd editors/vscode && npm run update-manifest"
