"""Hostile input for `codespec lsp`, written to its stdin as raw bytes (no LSP client library in between, so
anything can be sent): malformed JSON-RPC, requests before initialize and after shutdown, unknown methods,
positions that do not exist, unpaired surrogates, a 5 MB document, bursts of edits, broken framing, stdin closed
mid-request, a model that does not load. Each request gets a JSON-RPC error or an empty result, never silence,
and a normal completion still works afterwards. On the tiny random model: the tests check the protocol."""

import asyncio
import itertools
import json
import sys

import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVER = [sys.executable, "-m", "codespec", "lsp", "--forward", "transformers", "--device", "cpu"]  # exact text: the CPU
SOURCE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    \n"
OPTIONS = {"debounce_ms": 0, "max_tokens": 8, "command_max_tokens": 16, "extra_tokens": 0}
SECONDS = 60  # no answer within this long counts as none

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
SERVER_NOT_INITIALIZED, REQUEST_FAILED, REQUEST_CANCELLED = -32002, -32803, -32800


def frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


class RawServer:
    """`codespec lsp` as a subprocess: bytes in, framed messages out. Answers arrive by id; requests from the
    server (workspace/applyEdit, ...) are answered with `replies[method]`, or null."""

    def __init__(self, process):
        self.process = process
        self.answers: dict = {}  # id -> the server's answer (answers with a null id go under None, in a list)
        self.notifications: list[dict] = []
        self.replies: dict = {}
        self.stderr = b""
        self.ids = itertools.count(1)
        self.arrived = asyncio.Condition()
        self.tasks = [asyncio.ensure_future(self.read_stdout()), asyncio.ensure_future(self.read_stderr())]

    @classmethod
    async def start(cls, *args) -> "RawServer":
        process = await asyncio.create_subprocess_exec(*SERVER, *args, stdin=asyncio.subprocess.PIPE,
                                                       stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE, limit=1 << 24)
        return cls(process)

    async def read_stdout(self) -> None:
        stdout = self.process.stdout
        while True:
            length = None
            while (line := await stdout.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            if not line:
                return
            message = json.loads(await stdout.readexactly(length))
            if "method" in message and "id" in message:  # a request from the server
                self.send({"jsonrpc": "2.0", "id": message["id"], "result": self.replies.get(message["method"])})
            elif "method" in message:
                self.notifications.append(message)
            elif message.get("id") is None:
                self.answers.setdefault(None, []).append(message)
            else:
                self.answers[message["id"]] = message
            async with self.arrived:
                self.arrived.notify_all()

    async def read_stderr(self) -> None:
        while chunk := await self.process.stderr.read(1 << 16):
            self.stderr += chunk

    def write(self, data: bytes) -> None:
        self.process.stdin.write(data)

    def send(self, message: dict) -> None:
        self.write(frame(json.dumps(message).encode()))

    def request(self, method: str, params=None, msg_id=None):
        """Send a request; returns its id."""
        msg_id = next(self.ids) if msg_id is None else msg_id
        self.send({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        return msg_id

    def notify(self, method: str, params=None) -> None:
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    async def answer(self, msg_id, seconds: float = SECONDS) -> dict:
        async def arrived():
            async with self.arrived:
                await self.arrived.wait_for(lambda: self.answers.get(msg_id))
        await asyncio.wait_for(arrived(), seconds)
        return self.answers.pop(msg_id) if msg_id is not None else self.answers[None].pop(0)

    async def call(self, method: str, params=None) -> dict:
        return await self.answer(self.request(method, params))

    async def initialize(self, **options) -> dict:
        result = await self.call("initialize", {"processId": None, "capabilities": {},
                                                "initializationOptions": {**OPTIONS, **options}})
        self.notify("initialized", {})
        return result

    def open(self, name: str, text: str = SOURCE) -> str:
        uri = f"file:///work/{name}"
        self.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1,
                                                              "text": text}})
        return uri

    def complete(self, uri: str, line: int, character: int, msg_id=None):
        return self.request("textDocument/inlineCompletion", {
            "textDocument": {"uri": uri}, "position": {"line": line, "character": character},
            "context": {"triggerKind": 1}}, msg_id)

    async def completes(self, uri: str, line: int = 5, character: int = 4) -> list:
        """A completion's items; fails on an error."""
        answer = await self.answer(self.complete(uri, line, character))
        assert "error" not in answer, answer
        return answer["result"]["items"]

    async def exits(self, seconds: float = 30) -> int:
        return await asyncio.wait_for(self.process.wait(), seconds)

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        for task in self.tasks:
            await task


def error_code(answer: dict):
    return answer.get("error", {}).get("code")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lsp(tiny_dir):
    """One server for the module. Before initialize it gets a request; right after, while the model loads, a
    completion that is cancelled at once (VS Code does that on every keystroke); both answers are kept."""
    server = await RawServer.start("--model", str(tiny_dir))
    try:
        server.before_initialize = await server.answer(server.complete("file:///work/early.py", 0, 0))
        await server.initialize()
        uri = server.open("loading.py")
        server.complete(uri, 5, 4, msg_id="while-loading")
        server.notify("$/cancelRequest", {"id": "while-loading"})
        server.cancelled_while_loading = await server.answer("while-loading")
        yield server
        assert "error" not in await server.call("shutdown")
        server.notify("exit")
        assert await server.exits() == 0
    finally:
        await server.stop()


async def test_a_request_before_initialize_gets_server_not_initialized(lsp):
    assert error_code(lsp.before_initialize) == SERVER_NOT_INITIALIZED


async def test_a_request_cancelled_while_the_model_loads_leaves_the_load_alone(lsp):
    assert error_code(lsp.cancelled_while_loading) == REQUEST_CANCELLED
    assert await lsp.completes(lsp.open("after-load.py"))


MALFORMED = {  # name -> (body, the error code of the answer, its id; None: no answer is due)
    "not JSON": (b'{"jsonrpc": "2.0", "id": 1, "method": ', PARSE_ERROR, None),
    "not UTF-8": (b'{"jsonrpc": "2.0", "id": 1, "method": "\xff\xfe"}', PARSE_ERROR, None),
    "a JSON array": (b'[{"jsonrpc": "2.0", "id": "in-array", "method": "shutdown"}]', INVALID_REQUEST, None),
    "a JSON number": (b"42", INVALID_REQUEST, None),
    "no jsonrpc member": (b'{"id": "no-version", "method": "shutdown"}', INVALID_REQUEST, "no-version"),
    "jsonrpc 1.0": (b'{"jsonrpc": "1.0", "id": "old", "method": "shutdown"}', INVALID_REQUEST, "old"),
    "an object for an id": (b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "textDocument/inlineCompletion",'
                            b' "params": {}}', INVALID_REQUEST, None),
    "params of the wrong shape": (b'{"jsonrpc": "2.0", "id": "shape", "method": "textDocument/inlineCompletion",'
                                  b' "params": {"textDocument": 5, "position": "x"}}', INVALID_PARAMS, "shape"),
    "unknown method": (b'{"jsonrpc": "2.0", "id": "unknown", "method": "codespec/noSuchMethod", "params": {}}',
                       METHOD_NOT_FOUND, "unknown"),
    "unknown $/ request": (b'{"jsonrpc": "2.0", "id": "dollar", "method": "$/noSuchThing"}', METHOD_NOT_FOUND,
                           "dollar"),
    "unknown notification": (b'{"jsonrpc": "2.0", "method": "$/noSuchThing", "params": {}}', None, None),
    "an answer to nothing": (b'{"jsonrpc": "2.0", "id": "nobody-asked", "result": null}', None, None),
    "a cancel for nothing": (b'{"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": "nothing"}}',
                             None, None),
}


@pytest.mark.parametrize("case", MALFORMED)
async def test_malformed_json_rpc_gets_an_error_and_the_server_stays_up(lsp, case):
    body, code, msg_id = MALFORMED[case]
    lsp.write(frame(body))
    if code is not None:
        assert error_code(await lsp.answer(msg_id)) == code
    assert await lsp.completes(lsp.open("alive.py"))


@pytest.mark.parametrize("line, character", [(0, -1), (-1, 0), (7, 0), (0, 99), (2 ** 31, 0), (0, 2 ** 40)])
async def test_positions_that_do_not_exist_get_invalid_params(lsp, line, character):
    uri = lsp.open("positions.py")
    assert error_code(await lsp.answer(lsp.complete(uri, line, character))) == INVALID_PARAMS
    assert await lsp.completes(uri)


async def test_a_change_to_an_unopened_document_is_ignored(lsp):
    uri = "file:///work/never-opened.py"
    lsp.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": 2},
                                          "contentChanges": [{"text": SOURCE}]})
    assert error_code(await lsp.answer(lsp.complete(uri, 5, 4))) == INVALID_PARAMS
    assert await lsp.completes(lsp.open("alive.py"))


async def test_an_unpaired_surrogate_in_one_document_breaks_no_completion(lsp):
    lsp.notify("workspace/didChangeConfiguration", {"settings": {"codespec": {"extra_tokens": 256}}})
    try:
        poisoned = lsp.open("surrogate.py", "s = '\ud800'\n" + SOURCE)  # json.dumps writes it as "\ud800"
        clean = lsp.open("clean.py")
        await asyncio.sleep(1.1)  # settled: the surrogate's document now feeds the shared pool
        assert await lsp.completes(clean)
        await lsp.completes(poisoned, 6, 4)
        lsp.notify("textDocument/didChange", {"textDocument": {"uri": poisoned, "version": 2}, "contentChanges": [
            {"range": {"start": {"line": 0, "character": 6}, "end": {"line": 0, "character": 6}}, "text": "\udfff"}]})
        await lsp.completes(poisoned, 0, 7)  # the surrogate is one UTF-16 unit, and still counts as one
        lsp.notify("textDocument/didClose", {"textDocument": {"uri": poisoned}})
        assert await lsp.completes(clean)  # the closed document is still other files' context
    finally:
        lsp.notify("workspace/didChangeConfiguration", {"settings": {"codespec": {"extra_tokens": 0}}})


async def test_a_5_mb_document_gets_an_empty_result_and_slows_no_other(lsp):
    big = lsp.open("big.py", "x = 1\n" * 900_000)  # 5.4 MB, over the default max_file_chars
    assert await lsp.completes(big, 900_000, 0) == []
    lsp.notify("textDocument/didChange", {"textDocument": {"uri": big, "version": 2}, "contentChanges": [
        {"range": {"start": {"line": 3, "character": 0}, "end": {"line": 3, "character": 0}}, "text": "y = 2\n"}]})
    assert error_code(await lsp.answer(lsp.complete(big, 900_002, 0))) == INVALID_PARAMS  # one line longer
    assert await lsp.completes(lsp.open("small.py"))
    lsp.notify("textDocument/didClose", {"textDocument": {"uri": big}})


def position_of(text: str, offset: int) -> dict:
    before = text[:offset]
    return {"line": before.count("\n"), "character": offset - (before.rfind("\n") + 1)}


async def test_a_burst_of_1000_edits_interleaved_with_completions(lsp):
    """Typing and deleting, a completion after every 25 edits (each supersedes the one before); afterwards the
    server's copy of the document matches the client's to the character."""
    uri = lsp.open("burst.py", "")
    text, typed, pending = "", itertools.cycle(SOURCE + "    result = [a * b for a in range(10)]\n"), []
    for version in range(2, 1002):
        if version % 7 == 0 and text:  # a backspace
            start = position_of(text, len(text) - 1)
            change = {"range": {"start": start, "end": position_of(text, len(text))}, "text": ""}
            text = text[:-1]
        else:
            char = next(typed)
            at = position_of(text, len(text))
            change = {"range": {"start": at, "end": at}, "text": char}
            text += char
        lsp.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                              "contentChanges": [change]})
        if version % 25 == 0:
            end = position_of(text, len(text))
            pending.append(lsp.complete(uri, end["line"], end["character"]))
    for msg_id in pending:
        assert "result" in await lsp.answer(msg_id)
    end = position_of(text, len(text))
    await lsp.completes(uri, end["line"], end["character"])
    past = lsp.complete(uri, end["line"], end["character"] + 1)
    assert error_code(await lsp.answer(past)) == INVALID_PARAMS


async def test_a_command_with_an_unpaired_surrogate_in_its_instruction(lsp):
    uri = lsp.open("command-surrogate.py")
    lsp.replies["workspace/applyEdit"] = {"applied": True}
    answer = await lsp.call("workspace/executeCommand", {"command": "codespec.rewriteSelection", "arguments": [
        {"uri": uri, "range": {"start": {"line": 0, "character": 0}, "end": {"line": 2, "character": 0}},
         "instruction": "rename \ud800 to b"}]})
    assert "result" in answer, answer


async def test_after_shutdown_requests_get_invalid_request_and_exit_ends_the_server(tiny_dir):
    server = await RawServer.start("--model", str(tiny_dir))
    try:
        await server.initialize()
        assert "error" not in await server.call("shutdown")
        assert error_code(await server.answer(server.complete("file:///work/late.py", 0, 0))) == INVALID_REQUEST
        assert error_code(await server.call("shutdown")) == INVALID_REQUEST
        server.notify("exit")
        assert await server.exits() == 0
    finally:
        await server.stop()


INITIALIZED = json.dumps({"jsonrpc": "2.0", "method": "initialized", "params": {}}).encode()
BROKEN_FRAMING = {
    "Content-Length is not a number": b"Content-Length: abc\r\n\r\n{}",
    "a body longer than its Content-Length": b"Content-Length: 20\r\n\r\n" + INITIALIZED,
}


@pytest.mark.parametrize("case", BROKEN_FRAMING)
async def test_broken_framing_ends_the_server_with_a_message(tiny_dir, case):
    """Past broken framing nothing can be read reliably: the server must not stay alive and deaf."""
    server = await RawServer.start("--model", str(tiny_dir))
    try:
        server.write(BROKEN_FRAMING[case])
        server.request("initialize", {"processId": None, "capabilities": {}})
        assert await server.exits() == 1
        await asyncio.gather(*server.tasks)
        assert b"the LSP stream is corrupt" in server.stderr, server.stderr.decode()
    finally:
        await server.stop()


async def test_closing_stdin_mid_request_ends_the_server(tiny_dir):
    server = await RawServer.start("--model", str(tiny_dir))
    try:
        await server.initialize()
        server.complete(server.open("closing.py"), 5, 4)  # while the model loads
        server.process.stdin.close()
        assert await server.exits() == 0
    finally:
        await server.stop()


async def test_a_model_that_fails_to_load_fails_each_request_with_its_reason(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    server = await RawServer.start("--model", str(tmp_path))
    try:
        await server.initialize()
        uri = server.open("no-model.py")
        for _ in range(2):  # the first waits for the load, the second finds it failed
            answer = await server.answer(server.complete(uri, 5, 4))
            assert error_code(answer) == REQUEST_FAILED and "could not be loaded" in answer["error"]["message"]
        command = await server.call("workspace/executeCommand", {"command": "codespec.addDocstrings", "arguments": [
            {"uri": uri, "range": {"start": {"line": 0, "character": 0}, "end": {"line": 2, "character": 0}}}]})
        assert error_code(command) == REQUEST_FAILED
    finally:
        await server.stop()
