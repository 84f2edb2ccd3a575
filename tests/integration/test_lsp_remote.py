"""`codespec lsp --server URL`, the thin language server, driving a real `codespec serve` (a uvicorn subprocess
on the default model, with an API key) over loopback, end to end with pytest-lsp: an inline completion whose
document keeps its server session, a rewrite command whose edit is what plain greedy decoding writes for the
chat prompt, cancellation that closes the HTTP stream (the server sees it and cancels the job), a wrong API key
(401), and a server that is not there."""

import asyncio
import os
import re
import subprocess
import sys
import time

import httpx
import pytest
import pytest_lsp
from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcRequestCancelled
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities

from codespec.config import SamplingParams, SpecConfig
from codespec.context.treesitter import indent_of
from lsp import commands, prompts
from lsp.protocol import ADD_DOCSTRINGS, REWRITE_SELECTION, SETTINGS_SECTION, STATS_NOTIFICATION
from tests.serving import free_port
from tests.integration.test_lsp import RANGE, SOURCE  # the same document and selection

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

KEY = "team-key"
PORT = free_port()
URL = f"http://127.0.0.1:{PORT}"
THIN = [sys.executable, "-m", "codespec", "lsp", "--server", URL]
URI = "file:///work/stats.py"
SETTINGS = {"debounce_ms": 0, "max_tokens": 64, "command_max_tokens": 160}


@pytest.fixture(scope="module")
def http_server():
    """`codespec serve` with an API key, in float32 (exactness is checked in fp32)."""
    process = subprocess.Popen([sys.executable, "-m", "codespec", "serve", "--port", str(PORT), "--dtype", "float32",
                                "--api-key", KEY], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "CODESPEC_API_KEY": ""})
    client = httpx.Client(base_url=URL, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + 180
    try:
        while True:
            assert process.poll() is None, process.stderr.read()
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield client
    finally:
        process.terminate()
        process.wait(timeout=30)
        client.close()


def metric(client: httpx.Client, name: str) -> float:
    """A Prometheus sample's value summed over its labels (0 when absent)."""
    text = client.get("/metrics").text
    return sum(float(match) for match in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


async def start(lsp_client: LanguageClient, settings: dict = SETTINGS) -> None:
    lsp_client.applied_edits, lsp_client.stats = [], []

    @lsp_client.feature(types.WORKSPACE_APPLY_EDIT)
    def apply_edit(params: types.ApplyWorkspaceEditParams):
        lsp_client.applied_edits.append(params)
        return types.ApplyWorkspaceEditResult(applied=True)

    @lsp_client.feature(STATS_NOTIFICATION)
    def stats(params):  # pygls reads params of a method it has no type for as a namedtuple
        lsp_client.stats.append(params if isinstance(params, dict) else params._asdict())

    await lsp_client.initialize_session(types.InitializeParams(
        capabilities=client_capabilities("neovim"), initialization_options={SETTINGS_SECTION: settings}))
    lsp_client.text_document_did_open(types.DidOpenTextDocumentParams(types.TextDocumentItem(
        uri=URI, language_id="python", version=1, text=SOURCE)))


@pytest_lsp.fixture(scope="module", config=ClientServerConfig(
    server_command=THIN, server_env={**os.environ, "CODESPEC_API_KEY": KEY}))
async def client(lsp_client: LanguageClient, http_server):
    await start(lsp_client)
    yield
    await lsp_client.shutdown_session()


@pytest_lsp.fixture(scope="module", config=ClientServerConfig(
    server_command=THIN, server_env={**os.environ, "CODESPEC_API_KEY": "wrong-key"}))
async def wrong_key_client(lsp_client: LanguageClient, http_server):
    await start(lsp_client)
    yield
    await lsp_client.shutdown_session()


@pytest_lsp.fixture(scope="module", config=ClientServerConfig(
    server_command=[sys.executable, "-m", "codespec", "lsp", "--server", f"http://127.0.0.1:{free_port()}"]))
async def unreachable_client(lsp_client: LanguageClient):
    await start(lsp_client)
    yield
    await lsp_client.shutdown_session()


def inline(line: int, character: int) -> types.InlineCompletionParams:
    return types.InlineCompletionParams(
        text_document=types.TextDocumentIdentifier(URI), position=types.Position(line, character),
        context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked))


def rewrite(client: LanguageClient, command: str = REWRITE_SELECTION.id, selection: types.Range = RANGE
            ) -> types.ExecuteCommandParams:
    arguments = {"uri": URI, "range": client.protocol._converter.unstructure(selection)}
    if command == REWRITE_SELECTION.id:
        arguments["instruction"] = "rename the variable total to running_sum"
    return types.ExecuteCommandParams(command=command, arguments=[arguments])


async def until(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_block_completion_comes_from_the_server_and_the_document_keeps_its_session(
        client: LanguageClient, http_server):
    result = await client.text_document_inline_completion_async(inline(16, 4))
    (item,) = result.items
    assert item.range.start == item.range.end == types.Position(line=16, character=4)
    lines = item.insert_text.split("\n")
    assert lines[0].strip(), item.insert_text  # code on the cursor's line
    assert all(indent_of(line) >= 4 for line in lines[1:] if line.strip()), item.insert_text  # inside variance()

    sessions = [slot["session"] for slot in http_server.get("/slots").json() if slot["session"].startswith("lsp-")]
    assert len(sessions) == 1, sessions  # the document's own named session, not a shared slot
    await client.text_document_inline_completion_async(inline(16, 4))  # the next keystroke's request
    assert client.stats[-1]["kind"] == "completion"
    assert client.stats[-1]["cached_tokens"] >= client.stats[-1]["prompt_tokens"] - 8  # its KV cache was reused
    assert [slot["session"] for slot in http_server.get("/slots").json() if slot["session"].startswith("lsp-")] == sessions


async def test_a_rewrite_comes_back_as_an_edit_that_is_plain_greedy(client: LanguageClient, default_engine):
    result = await client.workspace_execute_command_async(rewrite(client))
    assert result["applied"] is True
    (edit,) = client.applied_edits
    (change,) = edit.edit.changes[URI]  # neovim takes plain changes
    assert change.range == RANGE
    assert result["stats"]["generated_tokens"] > 0 and result["stats"]["prompt_tokens"] > 0

    # the chat prompt the server built, decoded plainly in this process: the answer's fence line dropped, up to
    # the closing fence
    selection = SOURCE[SOURCE.index("def mean"): SOURCE.index("def variance")].rstrip("\n") + "\n"
    values = {"instruction": "rename the variable total to running_sum"}
    user, _ = prompts.request_text(REWRITE_SELECTION.id, values, selection, "python")
    plain = default_engine.generate(default_engine.encode(user, chat=True), SamplingParams(
        max_tokens=168, stop=("\n" + prompts.FENCE,)), spec=SpecConfig(spec=("none",))).text
    first, _, rest = plain.partition("\n")
    expected = rest if first.startswith(prompts.FENCE) else plain
    assert change.new_text == commands.fit_to_selection(expected, selection)


async def test_a_cancelled_command_closes_its_stream_and_the_server_cancels_the_job(client: LanguageClient,
                                                                                   http_server):
    cancelled_before = metric(http_server, "codespec_cancelled_total")
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings={SETTINGS_SECTION: {
        "command_max_tokens": 2048, "command_spec": ["none"]}}))  # plain decoding: it runs for a long while
    edits_before = len(client.applied_edits)
    try:
        whole = types.Range(start=types.Position(0, 0), end=types.Position(16, 0))  # a long answer
        request = asyncio.ensure_future(client.protocol.send_request_async(
            types.WORKSPACE_EXECUTE_COMMAND, rewrite(client, ADD_DOCSTRINGS.id, whole), msg_id="cancel-remote"))
        await until(lambda: metric(http_server, "codespec_active_generations") >= 1)
        client.cancel_request(types.CancelParams(id="cancel-remote"))
        with pytest.raises(JsonRpcRequestCancelled):
            print("not cancelled:", await request)
        # the server saw the stream closed: the job is cancelled and frees the engine at its next step
        await until(lambda: metric(http_server, "codespec_cancelled_total") > cancelled_before, seconds=30)
        await until(lambda: metric(http_server, "codespec_active_generations") == 0, seconds=30)
    finally:
        client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings={SETTINGS_SECTION: {
            "command_max_tokens": 160, "command_spec": ["edit-align", "ngram-mod", "prompt-lookup"]}}))
    assert len(client.applied_edits) == edits_before


async def test_a_wrong_api_key_is_a_json_rpc_error_and_the_setting_fixes_it(wrong_key_client: LanguageClient):
    with pytest.raises(JsonRpcException, match="401"):
        await wrong_key_client.text_document_inline_completion_async(inline(16, 4))
    with pytest.raises(JsonRpcException, match="API key"):
        await wrong_key_client.workspace_execute_command_async(rewrite(wrong_key_client))
    assert not wrong_key_client.applied_edits
    wrong_key_client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
        settings={SETTINGS_SECTION: {"api_key": KEY}}))
    result = await wrong_key_client.text_document_inline_completion_async(inline(16, 4))
    assert result.items


async def test_an_unreachable_server_gives_empty_completions_and_command_errors(unreachable_client: LanguageClient):
    for _ in range(2):  # and the language server is still there to answer the next request
        result = await unreachable_client.text_document_inline_completion_async(inline(16, 4))
        assert not result.items
    warnings = [log.message for log in unreachable_client.log_messages if "cannot reach" in log.message]
    assert len(warnings) == 1, unreachable_client.log_messages  # said once, not at every keystroke
    with pytest.raises(JsonRpcException, match="cannot reach"):
        await unreachable_client.workspace_execute_command_async(rewrite(unreachable_client))
    assert not unreachable_client.applied_edits
