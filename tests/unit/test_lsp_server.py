"""`codespec lsp` end to end over stdio, driven by pytest-lsp's client, on the tiny random model (fast; what
it writes is noise, so these tests check the protocol, not the text)."""

import asyncio
import inspect
import json
import socket
import sys
import uuid
from concurrent.futures import Future
from typing import Union

import pytest
import pytest_lsp
from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams, JsonRpcRequestCancelled
from pygls.lsp.client import LanguageClient as PyglsClient
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities

from lsp.protocol import ADD_DOCSTRINGS, COMMANDS, REWRITE_SELECTION, SETTINGS_SECTION, STATS_NOTIFICATION, Settings
from lsp.server import CodespecServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

# the transformers forward: the lean path's TorchScript warm-up costs more than a tiny model's whole test
SERVER = [sys.executable, "-m", "codespec", "lsp", "--forward", "transformers", "--device", "cpu"]  # exact text: the CPU
SOURCE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    \n"
DEFAULTS = {"max_tokens": 12, "command_max_tokens": 150, "debounce_ms": 0, "max_file_chars": 20_000}


def fix_code_action_parsing(client: LanguageClient) -> None:
    """lsprotocol's client-side hook reads every object with a "command" key as a Command, so a CodeAction
    that carries a command comes back mangled; the wire format is right, this fixes the test client's reading."""
    converter = client.protocol._converter

    def structure(obj, _):
        return converter.structure(obj, types.Command if isinstance(obj.get("command"), str) else types.CodeAction)

    converter.register_structure_hook(Union[types.Command, types.CodeAction], structure)


@pytest_lsp.fixture(scope="module", config=ClientServerConfig(server_command=SERVER))
async def client(lsp_client: LanguageClient, tiny_dir):
    fix_code_action_parsing(lsp_client)
    lsp_client.applied_edits, lsp_client.stats = [], []
    lsp_client.hold_edits = None  # an asyncio.Event that workspace/applyEdit waits for before it answers

    @lsp_client.feature(types.WORKSPACE_APPLY_EDIT)
    async def apply_edit(params: types.ApplyWorkspaceEditParams):
        lsp_client.applied_edits.append(params)
        if lsp_client.hold_edits is not None:
            await lsp_client.hold_edits.wait()
        return types.ApplyWorkspaceEditResult(applied=True)

    @lsp_client.feature(STATS_NOTIFICATION)
    def stats(params):
        lsp_client.stats.append(params)

    lsp_client.init_result = await lsp_client.initialize_session(types.InitializeParams(
        capabilities=client_capabilities("visual-studio-code"),  # workDoneProgress, documentChanges, configuration
        initialization_options={SETTINGS_SECTION: {"model": str(tiny_dir), **DEFAULTS}}))
    yield
    await lsp_client.shutdown_session()


def open_document(client, name: str, text: str = SOURCE, language: str = "python") -> str:
    uri = f"file:///work/{name}"
    client.text_document_did_open(types.DidOpenTextDocumentParams(
        types.TextDocumentItem(uri=uri, language_id=language, version=1, text=text)))
    return uri


def inline_params(uri, line, character, invoked=True):
    kind = types.InlineCompletionTriggerKind.Invoked if invoked else types.InlineCompletionTriggerKind.Automatic
    return types.InlineCompletionParams(text_document=types.TextDocumentIdentifier(uri),
                                        position=types.Position(line, character),
                                        context=types.InlineCompletionContext(trigger_kind=kind))


def configure(client, **values):
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
        settings={SETTINGS_SECTION: values}))


async def until(condition, seconds=60.0):
    """Wait for something the server sends on its own (progress, logs); bounded, never a timing assertion."""
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the server never sent it")


def selection_arguments(uri, start, end, **extra):
    return [{"uri": uri, "range": {"start": {"line": start[0], "character": start[1]},
                                   "end": {"line": end[0], "character": end[1]}}, **extra}]


async def test_capabilities_are_advertised(client: LanguageClient):
    capabilities = client.init_result.capabilities
    assert isinstance(capabilities.inline_completion_provider, types.InlineCompletionOptions)
    assert capabilities.completion_provider is not None
    assert capabilities.text_document_sync.change == types.TextDocumentSyncKind.Incremental
    assert types.CodeActionKind.RefactorRewrite in capabilities.code_action_provider.code_action_kinds
    assert set(capabilities.execute_command_provider.commands) == {command.id for command in COMMANDS}


async def test_inline_completion_comes_back_at_the_cursor(client: LanguageClient):
    uri = open_document(client, "inline.py")
    before = len(client.stats)
    result = await client.text_document_inline_completion_async(inline_params(uri, 5, 4))
    assert len(result.items) == 1
    item = result.items[0]
    cursor = types.Position(line=5, character=4)
    assert item.range == types.Range(start=cursor, end=cursor) and item.insert_text.strip()
    await until(lambda: len(client.stats) > before)
    stats = client.stats[-1]
    assert stats.kind == "completion" and 0 < stats.generated_tokens <= DEFAULTS["max_tokens"]


async def test_the_suggestion_after_an_accept_was_computed_while_the_first_was_shown(client: LanguageClient):
    """Accept-ahead: accepting the shown suggestion (inserting it, the cursor after it) and asking again is answered
    from the work done in the background; any other edit is answered afresh."""
    uri = open_document(client, "ahead.py")
    first = (await client.text_document_inline_completion_async(inline_params(uri, 5, 4))).items[0].insert_text
    lines = (SOURCE[: SOURCE.index("    \n", SOURCE.index("def mul")) + 4] + first).split("\n")
    end = types.Position(len(lines) - 1, len(lines[-1]))
    client.text_document_did_change(types.DidChangeTextDocumentParams(
        types.VersionedTextDocumentIdentifier(uri=uri, version=2),
        [types.TextDocumentContentChangePartial(range=types.Range(types.Position(5, 4), types.Position(5, 4)),
                                                text=first)]))
    before = len(client.stats)
    result = await client.text_document_inline_completion_async(inline_params(uri, end.line, end.character))
    await until(lambda: len(client.stats) > before)
    assert client.stats[-1].precomputed is True
    assert not result.items or result.items[0].range == types.Range(start=end, end=end)
    client.text_document_did_change(types.DidChangeTextDocumentParams(  # typing something else instead
        types.VersionedTextDocumentIdentifier(uri=uri, version=3),
        [types.TextDocumentContentChangePartial(range=types.Range(end, end), text="x")]))
    before = len(client.stats)
    await client.text_document_inline_completion_async(inline_params(uri, end.line, end.character + 1))
    await until(lambda: len(client.stats) > before)
    assert client.stats[-1].precomputed is False


async def test_completion_fallback_has_a_text_edit_at_the_cursor(client: LanguageClient):
    uri = open_document(client, "fallback.py")
    result = await client.text_document_completion_async(types.CompletionParams(
        text_document=types.TextDocumentIdentifier(uri), position=types.Position(line=5, character=4)))
    assert len(result.items) == 1
    edit = result.items[0].text_edit
    cursor = types.Position(line=5, character=4)
    assert edit.range == types.Range(start=cursor, end=cursor) and edit.new_text.strip()


async def test_incremental_changes_reach_the_server(client: LanguageClient):
    uri = open_document(client, "incremental.py", "x = 1\n")
    with pytest.raises(JsonRpcInvalidParams):  # line 2 does not exist yet
        await client.text_document_inline_completion_async(inline_params(uri, 2, 4))
    client.text_document_did_change(types.DidChangeTextDocumentParams(
        text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=2),
        content_changes=[types.TextDocumentContentChangePartial(
            range=types.Range(start=types.Position(line=1, character=0), end=types.Position(line=1, character=0)),
            text="def f(y):\n    ")]))
    result = await client.text_document_inline_completion_async(inline_params(uri, 2, 4))
    assert result.items and result.items[0].range.start == types.Position(line=2, character=4)


async def test_cancel_request_cancels_a_completion(client: LanguageClient):
    uri = open_document(client, "cancel.py")
    configure(client, debounce_ms=5000)
    try:
        pending = asyncio.ensure_future(client.protocol.send_request_async(  # sent now, answered later
            types.TEXT_DOCUMENT_INLINE_COMPLETION, inline_params(uri, 5, 4, invoked=False), msg_id="cancel-me"))
        await asyncio.sleep(0.2)
        client.cancel_request(types.CancelParams(id="cancel-me"))
        with pytest.raises(JsonRpcRequestCancelled):
            await pending
    finally:
        configure(client, debounce_ms=0)


async def test_a_newer_request_supersedes_an_older_one(client: LanguageClient):
    uri = open_document(client, "supersede.py")
    configure(client, debounce_ms=400)
    try:
        older = client.text_document_inline_completion_async(inline_params(uri, 5, 4, invoked=False))
        newer = client.text_document_inline_completion_async(inline_params(uri, 5, 4, invoked=False))
        older, newer = await asyncio.gather(older, newer)
        assert not older.items and len(newer.items) == 1
    finally:
        configure(client, debounce_ms=0)


async def code_action_command(client, uri, start, end, index=0) -> types.Command:
    actions = await client.text_document_code_action_async(types.CodeActionParams(
        text_document=types.TextDocumentIdentifier(uri),
        range=types.Range(start=types.Position(*start), end=types.Position(*end)),
        context=types.CodeActionContext(diagnostics=[])))
    assert [action.title for action in actions] == [command.title for command in COMMANDS]
    assert all(action.kind == types.CodeActionKind.RefactorRewrite for action in actions)
    return actions[index].command


async def test_code_action_command_sends_an_edit_with_progress_and_stats(client: LanguageClient):
    uri = open_document(client, "command.py")
    command = await code_action_command(client, uri, (0, 0), (2, 0))
    assert command.command == REWRITE_SELECTION.id
    arguments = [dict(command.arguments[0], instruction="rename a to first")]
    tokens_before, edits_before = set(client.progress_reports), len(client.applied_edits)
    result = await client.workspace_execute_command_async(types.ExecuteCommandParams(
        command=command.command, arguments=arguments))
    assert result["applied"] is True and result["cancelled"] is False
    assert result["stats"]["kind"] == REWRITE_SELECTION.id and result["stats"]["generated_tokens"] > 0

    assert len(client.applied_edits) == edits_before + 1
    change = client.applied_edits[-1].edit.document_changes[0]  # a versioned edit: the client said it takes them
    assert change.text_document.uri == uri and change.text_document.version == 1
    assert change.edits[0].range == types.Range(start=types.Position(line=0, character=0),
                                                end=types.Position(line=2, character=0))
    assert change.edits[0].new_text.endswith("\n")  # the selection ended with a line break, so does the edit

    (token,) = set(client.progress_reports) - tokens_before
    reports = client.progress_reports[token]
    assert reports[0].kind == "begin" and reports[0].cancellable and reports[-1].kind == "end"
    assert "tok/s" in reports[-1].message and "acceptance" in reports[-1].message
    assert any(stats.kind == REWRITE_SELECTION.id for stats in client.stats)


async def test_no_code_actions_for_an_empty_selection(client: LanguageClient):
    uri = open_document(client, "empty-selection.py")
    actions = await client.text_document_code_action_async(types.CodeActionParams(
        text_document=types.TextDocumentIdentifier(uri), range=types.Range(start=types.Position(1, 2),
                                                                              end=types.Position(1, 2)),
        context=types.CodeActionContext(diagnostics=[])))
    assert not actions


async def start_command_and_wait_for_progress(client, uri, msg_id):
    tokens_before = set(client.progress_reports)
    request = asyncio.ensure_future(client.protocol.send_request_async(
        types.WORKSPACE_EXECUTE_COMMAND, types.ExecuteCommandParams(
            command=ADD_DOCSTRINGS.id, arguments=selection_arguments(uri, (0, 0), (5, 4))), msg_id=msg_id))
    await until(lambda: set(client.progress_reports) - tokens_before)
    (token,) = set(client.progress_reports) - tokens_before
    return request, token


async def test_cancelling_the_progress_stops_a_command(client: LanguageClient):
    uri = open_document(client, "progress-cancel.py")
    edits_before = len(client.applied_edits)
    request, token = await start_command_and_wait_for_progress(client, uri, "progress-cancel")
    client.window_work_done_progress_cancel(types.WorkDoneProgressCancelParams(token=token))
    result = await request
    assert result["cancelled"] is True and result["applied"] is False
    assert client.progress_reports[token][-1].kind == "end"
    assert len(client.applied_edits) == edits_before


async def test_cancel_request_stops_a_command(client: LanguageClient):
    uri = open_document(client, "request-cancel.py")
    edits_before = len(client.applied_edits)
    request, token = await start_command_and_wait_for_progress(client, uri, "command-cancel")
    client.cancel_request(types.CancelParams(id="command-cancel"))
    with pytest.raises(JsonRpcRequestCancelled):
        await request
    await until(lambda: client.progress_reports[token][-1].kind == "end")
    assert len(client.applied_edits) == edits_before


async def test_cancel_request_while_the_client_applies_the_edit_ends_the_progress(client: LanguageClient):
    uri = open_document(client, "apply-cancel.py")
    edits_before, messages_before = len(client.applied_edits), len(client.messages)
    client.hold_edits = asyncio.Event()
    try:
        request = asyncio.ensure_future(client.protocol.send_request_async(
            types.WORKSPACE_EXECUTE_COMMAND, types.ExecuteCommandParams(
                command=REWRITE_SELECTION.id, arguments=selection_arguments(uri, (0, 0), (2, 0), instruction="go")),
            msg_id="apply-cancel"))
        await until(lambda: len(client.applied_edits) > edits_before)  # the server awaits the client's answer
        (token,) = [token for token, reports in client.progress_reports.items() if reports[-1].kind != "end"]
        client.cancel_request(types.CancelParams(id="apply-cancel"))
        with pytest.raises(JsonRpcRequestCancelled):
            await request
        await until(lambda: client.progress_reports[token][-1].kind == "end")
    finally:
        client.hold_edits.set()
        client.hold_edits = None
    # the client's late answer reached a request that was still pending: no error shown to the user
    assert (await client.text_document_inline_completion_async(inline_params(uri, 5, 4))).items
    assert client.messages[messages_before:] == []


@pytest.mark.parametrize("delay", [0, 0.002, 0.01, 0.03, 0.1])
async def test_a_completion_cancelled_at_any_stage_is_answered_and_the_next_one_works(client: LanguageClient,
                                                                                    delay):
    """Cancelled before it starts, while the prompt is built, in prefill or in generation, or after it ended."""
    uri = open_document(client, f"cancel-{delay}.py")
    request = asyncio.ensure_future(client.protocol.send_request_async(
        types.TEXT_DOCUMENT_INLINE_COMPLETION, inline_params(uri, 5, 4), msg_id=f"cancel-{delay}"))
    await asyncio.sleep(delay)
    client.cancel_request(types.CancelParams(id=f"cancel-{delay}"))
    try:
        assert isinstance(await request, types.InlineCompletionList)  # it ended before the cancel arrived
    except JsonRpcRequestCancelled:
        pass
    assert (await client.text_document_inline_completion_async(inline_params(uri, 5, 4))).items


@pytest.mark.parametrize("delay", [0, 0.01, 0.05, 0.2])
async def test_a_command_cancelled_at_any_stage_is_answered_and_the_next_one_works(client: LanguageClient, delay):
    uri = open_document(client, f"command-cancel-{delay}.py")
    tokens_before = set(client.progress_reports)
    arguments = selection_arguments(uri, (0, 0), (2, 0), instruction="rename a to first")
    request = asyncio.ensure_future(client.protocol.send_request_async(
        types.WORKSPACE_EXECUTE_COMMAND, types.ExecuteCommandParams(command=REWRITE_SELECTION.id,
                                                                    arguments=arguments),
        msg_id=f"command-cancel-{delay}"))
    await asyncio.sleep(delay)
    client.cancel_request(types.CancelParams(id=f"command-cancel-{delay}"))
    try:
        assert "applied" in await request
    except JsonRpcRequestCancelled:
        pass
    result = await client.workspace_execute_command_async(types.ExecuteCommandParams(
        command=REWRITE_SELECTION.id, arguments=arguments))
    assert result["applied"] is True
    # every progress that began has ended (one whose creation was cancelled never began: nothing shows it)
    assert all(client.progress_reports[token][-1].kind == "end"
               for token in set(client.progress_reports) - tokens_before if client.progress_reports[token])


async def test_a_request_cancelled_while_the_model_loads_leaves_the_load_alone():
    """VS Code cancels the previous completion on every keystroke; during the load, that cancelled the load that
    every request shares, and the server never completed anything again."""
    server = CodespecServer()
    server._loading = True  # no load thread: the test ends the load itself
    waiting = asyncio.ensure_future(server.ready())
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    server._loaded.set_result("the scheduler")
    assert await server.ready() == "the scheduler"


async def raw_request(client, method, params):
    """Send params as given: dicts bypass the client's own types, so malformed ones reach the server."""
    if not isinstance(params, dict):
        return await client.protocol.send_request_async(method, params)
    msg_id = f"raw-{uuid.uuid4()}"
    answer = Future()
    client.protocol._request_futures[msg_id] = answer
    body = json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
    written = client.protocol.writer.write(f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    if inspect.isawaitable(written):
        await written
    return await asyncio.wrap_future(answer)


@pytest.mark.parametrize("case", [
    "unknown document", "past the end of a line (UTF-16)", "past the end of the document", "negative position",
    "malformed params", "command without arguments", "command with a bad range", "command on an empty selection",
    "command with an empty instruction", "unknown command", "code action on an unknown document",
])
async def test_bad_requests_get_json_rpc_errors_and_the_server_stays_up(client: LanguageClient, case):
    uri = open_document(client, "errors.py", "s = '😀'\n")  # line 0 is 7 code points, 8 UTF-16 units
    command = types.WORKSPACE_EXECUTE_COMMAND
    requests = {
        "unknown document": (types.TEXT_DOCUMENT_INLINE_COMPLETION, inline_params("file:///nowhere.py", 0, 0)),
        "past the end of a line (UTF-16)": (types.TEXT_DOCUMENT_INLINE_COMPLETION, inline_params(uri, 0, 9)),
        "past the end of the document": (types.TEXT_DOCUMENT_COMPLETION, types.CompletionParams(
            text_document=types.TextDocumentIdentifier(uri), position=types.Position(line=7, character=0))),
        "negative position": (types.TEXT_DOCUMENT_INLINE_COMPLETION,
                              {"textDocument": {"uri": uri}, "position": {"line": 0, "character": -3},
                               "context": {"triggerKind": 1}}),
        "malformed params": (types.TEXT_DOCUMENT_INLINE_COMPLETION, {"textDocument": {"uri": 5}, "position": "x"}),
        "command without arguments": (command, types.ExecuteCommandParams(command=ADD_DOCSTRINGS.id)),
        "command with a bad range": (command, types.ExecuteCommandParams(
            command=ADD_DOCSTRINGS.id, arguments=[{"uri": uri, "range": {"start": 3}}])),
        "command on an empty selection": (command, types.ExecuteCommandParams(
            command=ADD_DOCSTRINGS.id, arguments=selection_arguments(uri, (0, 2), (0, 2)))),
        "command with an empty instruction": (command, types.ExecuteCommandParams(
            command=REWRITE_SELECTION.id, arguments=selection_arguments(uri, (0, 0), (1, 0), instruction=" "))),
        "unknown command": (command, types.ExecuteCommandParams(command="codespec.noSuchThing", arguments=[])),
        "code action on an unknown document": (types.TEXT_DOCUMENT_CODE_ACTION, types.CodeActionParams(
            text_document=types.TextDocumentIdentifier("file:///nowhere.py"),
            range=types.Range(start=types.Position(0, 0), end=types.Position(0, 1)),
            context=types.CodeActionContext(diagnostics=[]))),
    }
    method, params = requests[case]
    with pytest.raises(JsonRpcException) as error:
        await raw_request(client, method, params)
    assert error.value.code == JsonRpcInvalidParams.CODE, error.value.message
    # the end of the line itself is a valid position, and the server still answers
    result = await client.text_document_inline_completion_async(inline_params(uri, 0, 8))
    assert isinstance(result, types.InlineCompletionList)


async def test_a_change_to_an_unknown_document_is_ignored(client: LanguageClient):
    client.text_document_did_change(types.DidChangeTextDocumentParams(
        text_document=types.VersionedTextDocumentIdentifier(uri="file:///never-opened.py", version=2),
        content_changes=[types.TextDocumentContentChangeWholeDocument(text="x")]))
    uri = open_document(client, "alive.py")
    assert (await client.text_document_inline_completion_async(inline_params(uri, 5, 4))).items


async def test_a_huge_file_gets_an_empty_result(client: LanguageClient):
    uri = open_document(client, "huge.py", "x = 1\n" * 5000)  # 30,000 characters > max_file_chars 20,000
    result = await client.text_document_inline_completion_async(inline_params(uri, 5000, 0))
    assert not result.items


async def test_settings_from_did_change_configuration_push_and_pull(client: LanguageClient):
    uri = open_document(client, "settings.py")
    configure(client, max_tokens=2, spec=["no-such-drafter"], draftMax=4)
    await until(lambda: any("no-such-drafter" in m.message for m in client.log_messages))
    before = len(client.stats)
    await client.text_document_inline_completion_async(inline_params(uri, 5, 4))
    await until(lambda: len(client.stats) > before)
    assert client.stats[-1].generated_tokens <= 2

    # the pull model: the notification carries no settings, the server asks for its section
    client.set_configuration({"max_tokens": 1, "bogus_key": 1}, section=SETTINGS_SECTION)
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings=None))
    await until(lambda: any("bogus_key" in m.message for m in client.log_messages))
    before = len(client.stats)
    await client.text_document_inline_completion_async(inline_params(uri, 5, 4))
    await until(lambda: len(client.stats) > before)
    assert client.stats[-1].generated_tokens <= 1
    configure(client, max_tokens=DEFAULTS["max_tokens"], draft_max=Settings().draft_max)


async def test_tcp_transport(tiny_dir):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = await asyncio.create_subprocess_exec(*SERVER, "--tcp", f"127.0.0.1:{port}",
                                                  stderr=asyncio.subprocess.DEVNULL)
    lsp = PyglsClient("tcp-test", "1")
    try:
        for _ in range(600):  # the server imports torch before it listens
            try:
                await lsp.start_tcp("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.05)
        await lsp.initialize_async(types.InitializeParams(
            capabilities=types.ClientCapabilities(),
            initialization_options={SETTINGS_SECTION: {"model": str(tiny_dir), **DEFAULTS}}))
        lsp.initialized(types.InitializedParams())
        uri = "file:///work/tcp.py"
        lsp.text_document_did_open(types.DidOpenTextDocumentParams(
            types.TextDocumentItem(uri=uri, language_id="python", version=1, text=SOURCE)))
        result = await lsp.text_document_inline_completion_async(inline_params(uri, 5, 4))
        assert len(result.items) == 1
        await lsp.shutdown_async(None)
        lsp.exit(None)
        assert await asyncio.wait_for(server.wait(), 30) == 0
    finally:
        if server.returncode is None:
            server.kill()
        await lsp.stop()
