"""`codespec lsp`: the language server. Inline completions from the open files, refactoring commands with
edit-aligned drafting, progress and statistics, on pygls.

The engine sits behind codespec's Scheduler: one worker thread owns the model and runs every generation step
by step, so an LSP server and an HTTP server in one process share one model and one n-gram pool, and a
cancelled request is a cancelled job. Handlers here are small; the work is in completion.py and commands.py.

Bad input never takes the server down, and every request gets an answer: unknown documents and positions that do
not exist (UTF-16 offsets past the end of a line or of the document) get a JSON-RPC InvalidParams error, malformed
params too; a body that is not JSON a ParseError; a message that is not JSON-RPC 2.0 and a request after shutdown
an InvalidRequest; a request before initialize ServerNotInitialized (pygls alone leaves all of these unanswered);
a huge file gets an empty result. A stream whose framing is broken ends the server (framing.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from concurrent.futures import Future
from dataclasses import asdict, replace

from lsprotocol import types
from pygls.exceptions import (JsonRpcException, JsonRpcInvalidParams, JsonRpcInvalidRequest, JsonRpcParseError,
                              JsonRpcServerNotInitialized)
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol

from codespec import __version__
from codespec.config import ModelConfig
from codespec.errors import CodespecError

from . import commands, settings as settings_module
from .backend import REQUEST_FAILED, LocalBackend
from .completion import Completer, Host, session_id
from .documents import Document, Documents, PositionError
from .fim_prompts import InfillPrompts
from .framing import CheckedInput
from .protocol import COMMANDS, SERVER_NAME, SETTINGS_SECTION, STATS_NOTIFICATION, Settings, Stats

logger = logging.getLogger("codespec.lsp")


class Malformed:
    """A request whose params did not match the method's shape: answered with InvalidParams."""

    def __init__(self, msg_id, error: JsonRpcException):
        self.id, self.error = msg_id, error


def request_id(message):
    """The id to answer a message with: its own when it is a JSON-RPC id (a string or an integer), else null."""
    msg_id = message.get("id") if isinstance(message, dict) else getattr(message, "id", None)
    return msg_id if isinstance(msg_id, (str, int)) and not isinstance(msg_id, bool) else None


class CodespecProtocol(LanguageServerProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cancel_hooks: dict = {}  # request id -> what cancels its work (pygls cannot reach into commands)
        self.initialize_seen = False

    def structure_message(self, data):
        if isinstance(data, dict) and "jsonrpc" in data and "method" in data:
            data.setdefault("params", None)  # JSON-RPC lets a message leave params out; pygls' generic types do not
        try:
            return super().structure_message(data)
        except JsonRpcException as error:
            if isinstance(data, dict) and "id" in data and "method" in data:
                return Malformed(data["id"], error)
            raise

    def handle_message(self, message):
        if isinstance(message, Malformed):
            if request_id(message) is None:
                self.answer(None, JsonRpcInvalidRequest("the id must be a string or an integer"))
            else:
                self.answer(message.id, JsonRpcInvalidParams(
                    f"malformed params: {message.error.message or 'they do not match the method'}"))
            return
        if getattr(message, "jsonrpc", None) != self.VERSION:  # a list, a number, an object without "jsonrpc"
            self.answer(request_id(message), JsonRpcInvalidRequest("not a JSON-RPC 2.0 request or notification"))
            return
        method = getattr(message, "method", None)
        if method is not None and hasattr(message, "id"):  # a request (notifications have no id, answers no method)
            if method == types.INITIALIZE:
                self.initialize_seen = True
            elif not self.initialize_seen:
                self.answer(message.id, JsonRpcServerNotInitialized(f"{method}: send initialize first"))
                return
            elif self._shutdown:
                self.answer(message.id, JsonRpcInvalidRequest(f"{method}: the server is shutting down"))
                return
        elif method is not None and method != types.EXIT and not self.initialize_seen:
            return  # a notification before initialize is dropped, as the specification asks
        super().handle_message(message)

    def answer(self, msg_id, error: JsonRpcException) -> None:
        self._send_response(msg_id, error=error.to_response_error())

    def _handle_cancel_notification(self, msg_id):
        hook = self.cancel_hooks.pop(msg_id, None)
        if hook is not None:
            hook()
        super()._handle_cancel_notification(msg_id)


class CodespecServer(LanguageServer):
    def __init__(self, model_config: ModelConfig | None = None, scheduler=None, model_fixed: bool = False,
                 server_url: str | None = None, api_key: str | None = None, cache_reuse: int = 0):
        """scheduler: share an engine already running in this process (an HTTP server's); else the model named by
        the settings is loaded after initialize. model_fixed: the model came from the command line and wins
        over initializationOptions. server_url: generate on that codespec HTTP server instead (no model here);
        api_key: its key (else $CODESPEC_API_KEY; the api_key setting replaces either). cache_reuse: the loaded
        engine's --cache-reuse (Engine.cache_reuse)."""
        super().__init__(SERVER_NAME, __version__, protocol_cls=CodespecProtocol,
                         text_document_sync_kind=types.TextDocumentSyncKind.Incremental)
        self.settings = Settings()
        self.model_config = model_config or ModelConfig()
        self.model_fixed = model_fixed
        self.cache_reuse = cache_reuse
        self.documents = Documents()
        self.converter = self.protocol._converter
        self._loaded: Future = Future()
        if scheduler is not None:
            self._loaded.set_result(scheduler)
        self.remote = server_url is not None
        self._loading = scheduler is not None or self.remote  # a thin language server never loads a model
        prompts = InfillPrompts(lambda: self.settings)  # completions' prompts: the backend builds, the Completer asks
        if self.remote:
            from .remote import RemoteBackend  # httpx is only imported by a thin language server

            self.backend = RemoteBackend(server_url, prompts, api_key)
        else:
            self.backend = LocalBackend(self.ready, prompts)
        self.completer = Completer(Host(
            documents=self.documents, settings=lambda: self.settings, backend=self.backend, prompts=prompts,
            document=self.document, offset=self.offset, ready_to_generate=self.ready_to_generate,
            send_stats=self.send_stats, report_unavailable=self.report_unavailable))
        self._unavailable: str | None = None  # the last "server unavailable" message logged

    # --- the engine ------------------------------------------------------------------------------------
    def start_loading(self) -> None:
        if self._loading:
            return
        self._loading = True
        threading.Thread(target=self._load, name="codespec-load", daemon=True).start()

    def _load(self) -> None:
        try:
            from codespec.cli.memory import lifelong_heap

            model = self.model_config.model if self.model_fixed else self.settings.model
            config = replace(self.model_config, model=model)
            with lifelong_heap():  # (the process's one engine: in `codespec lsp`, built without the collector)
                from codespec.engine import Engine
                from codespec.scheduler import Scheduler

                engine = Engine.load(config, settings_module.spec_config(self.settings), show_progress=False)
            engine.cache_reuse = self.cache_reuse
            scheduler = Scheduler(engine)
            scheduler.call_soon(lambda engine: engine.costs)  # the cost table now, not in the first completion
            self._loaded.set_result(scheduler)
        except BaseException as exc:  # reported to every request that needs the model
            logger.error("codespec: the model could not be loaded: %s", exc)
            self._loaded.set_exception(exc)

    async def ready(self):
        """The scheduler, once the model is loaded; a RequestFailed error if it could not be."""
        self.start_loading()
        try:
            # shielded: VS Code cancels the previous completion on every keystroke, and a cancelled request must
            # not cancel the load that every request waits for (the server would never complete again)
            return await asyncio.shield(asyncio.wrap_future(self._loaded))
        except Exception as exc:
            raise JsonRpcException(code=REQUEST_FAILED, message=f"the model could not be loaded: {exc}") from None

    async def ready_to_generate(self) -> None:
        """Wait for the model in process (a RequestFailed error if it could not be loaded); a thin language
        server's backend is always ready (its errors come with each request)."""
        if not self.remote:
            await self.ready()

    def context_length(self) -> int:
        return self._loaded.result().engine.context_length

    def report_unavailable(self, error: Exception | None) -> None:
        """A completion found the remote server busy or unreachable (it answered with an empty result): say so
        once in the client's log, and again only after a completion got through."""
        message = None if error is None else str(getattr(error, "message", error))
        if message is not None and self._unavailable is None:
            self.window_log_message(types.LogMessageParams(type=types.MessageType.Warning,
                                                           message=f"codespec: {message}"))
        self._unavailable = message

    def report_server_error(self, error: Exception, source) -> None:
        if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):  # a message body that is not JSON
            self.protocol.answer(None, JsonRpcParseError(f"the message is not JSON: {error}"))
            return
        super().report_server_error(error, source)

    # --- documents and positions -----------------------------------------------------------------------
    def document(self, uri: str) -> Document:
        try:
            return self.documents.get(uri)
        except KeyError as exc:
            raise JsonRpcInvalidParams(str(exc.args[0])) from None

    def offset(self, document: Document, line: int, character: int) -> int:
        try:
            return document.offset(line, character)
        except PositionError as exc:
            raise JsonRpcInvalidParams(str(exc)) from None

    # --- settings and notifications --------------------------------------------------------------------
    def configure(self, values: dict | None, source: str) -> None:
        if not values:
            return
        values = dict(values)
        for key in ("api_key", "apiKey"):  # a secret, not a protocol setting: kept out of protocol.json's schema
            key_value = values.pop(key, None)
            if isinstance(key_value, str) and key_value and self.remote:
                self.backend.api_key = key_value
        model = self.settings.model
        self.settings, problems = settings_module.apply(self.settings, values)
        if self._loading and self.settings.model != model:
            problems.append(f"the model is read once, at start; restart the server to use {self.settings.model!r}")
        for problem in problems:
            self.window_log_message(types.LogMessageParams(type=types.MessageType.Warning,
                                                           message=f"codespec: {source}: {problem} (ignored)"))

    def stats_params(self, kind: str, stats, precomputed: bool = False) -> dict:
        if stats is None:
            return asdict(Stats(kind, 0, 0.0, 0.0, 0.0, precomputed=precomputed))
        return asdict(Stats(kind, stats.generated_tokens, round(stats.tokens_per_second, 2),
                            round(stats.tokens_per_forward, 3), round(stats.acceptance_rate, 4),
                            stats.prompt_tokens, stats.cached_tokens, round(stats.seconds, 4),
                            round(stats.prefill_seconds, 4), precomputed))

    def send_stats(self, kind: str, stats, precomputed: bool = False) -> None:
        self.protocol.notify(STATS_NOTIFICATION, self.stats_params(kind, stats, precomputed))

    def stop_engine(self) -> None:
        """The client is gone: stop the engine's worker between two steps (a background job such as accept-ahead may
        still be running), so the process never exits in the middle of a forward."""
        if self._loaded.done() and self._loaded.exception() is None:
            self._loaded.result().close()

    async def forget(self, uri: str, pool: bool) -> None:
        """A document closed: its sessions go (their KV caches are not worth the memory). With `pool`, it also
        left the recently-closed list, and what its text taught the shared pool goes too."""
        if not self._loaded.done() or self._loaded.exception() is not None:
            return
        scheduler = self._loaded.result()

        def drop(engine) -> None:
            if pool:
                engine.forget_document(uri)
            busy = scheduler.busy_sessions()  # a command still running keeps its session until it ends
            for name in (session_id(uri), f"lsp-command:{uri}"):
                if name not in busy:
                    engine.drop(name, pool="forget")  # the pool takes back what the session taught it

        await scheduler.acall(drop)


def build_server(model_config: ModelConfig | None = None, scheduler=None, model_fixed: bool = False,
                 server_url: str | None = None, api_key: str | None = None, cache_reuse: int = 0) -> CodespecServer:
    server = CodespecServer(model_config, scheduler, model_fixed, server_url, api_key, cache_reuse)

    @server.feature(types.INITIALIZE)
    def initialize(ls: CodespecServer, params: types.InitializeParams):
        ls.configure(settings_module.section(params.initialization_options), "initializationOptions")
        ls.start_loading()

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: CodespecServer, params: types.DidOpenTextDocumentParams):
        item = params.text_document
        ls.documents.did_open(item.uri, item.text, item.version, item.language_id)

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: CodespecServer, params: types.DidChangeTextDocumentParams):
        try:
            ls.documents.did_change(params.text_document.uri, params.text_document.version, params.content_changes)
        except KeyError as exc:
            logger.warning("codespec: %s", exc.args[0])

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    async def did_close(ls: CodespecServer, params: types.DidCloseTextDocumentParams):
        uri = params.text_document.uri
        dropped = ls.documents.did_close(uri)
        ls.completer.forget(uri)
        await ls.forget(uri, pool=False)  # its text stays context for a while (Documents.closed)
        if dropped is not None:  # out of the recently-closed list: its text leaves the pool too
            await ls.forget(dropped.uri, pool=True)

    @server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
    async def did_change_configuration(ls: CodespecServer, params: types.DidChangeConfigurationParams):
        values = settings_module.section(params.settings)
        workspace = ls.client_capabilities.workspace
        if values is None and workspace is not None and workspace.configuration:
            # the pull model: the notification only says "something changed"
            answer = await ls.workspace_configuration_async(types.ConfigurationParams(
                items=[types.ConfigurationItem(section=SETTINGS_SECTION)]))
            values = answer[0] if answer and isinstance(answer[0], dict) else None
        ls.configure(values, "workspace/didChangeConfiguration")

    @server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(ls: CodespecServer, params: types.InlineCompletionParams):
        invoked = params.context is not None and params.context.trigger_kind == \
            types.InlineCompletionTriggerKind.Invoked
        completion = await ls.completer.complete(params.text_document.uri, params.position.line,
                                                 params.position.character, invoked)
        if completion is None:
            return types.InlineCompletionList(items=[])
        at = types.Position(line=completion.line, character=completion.character)
        return types.InlineCompletionList(items=[types.InlineCompletionItem(
            insert_text=completion.text, range=types.Range(start=at, end=at))])

    @server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions())
    async def completion(ls: CodespecServer, params: types.CompletionParams):
        invoked = params.context is None or params.context.trigger_kind == types.CompletionTriggerKind.Invoked
        result = await ls.completer.complete(params.text_document.uri, params.position.line,
                                             params.position.character, invoked)
        if result is None:
            return types.CompletionList(is_incomplete=True, items=[])
        at = types.Position(line=result.line, character=result.character)
        first_line = result.text.strip().split("\n", 1)[0]
        return types.CompletionList(is_incomplete=True, items=[types.CompletionItem(
            label=first_line[:80], kind=types.CompletionItemKind.Text, detail="codespec",
            insert_text_format=types.InsertTextFormat.PlainText, sort_text="0",
            text_edit=types.TextEdit(range=types.Range(start=at, end=at), new_text=result.text))])

    @server.feature(types.TEXT_DOCUMENT_CODE_ACTION,
                    types.CodeActionOptions(code_action_kinds=[types.CodeActionKind.RefactorRewrite]))
    def code_action(ls: CodespecServer, params: types.CodeActionParams):
        return commands.code_actions(ls, params)

    for command in COMMANDS:
        server.command(command.id)(command_handler(command.id))
    return server


def command_handler(command_id: str):
    async def run(ls: CodespecServer, *arguments):
        msg_id = ls.protocol.msg_id
        if msg_id is not None:  # $/cancelRequest for this executeCommand cancels this task
            ls.protocol.cancel_hooks[msg_id] = asyncio.current_task().cancel
        try:
            return await commands.execute(ls, command_id, list(arguments))
        finally:
            ls.protocol.cancel_hooks.pop(msg_id, None)

    run.__name__ = command_id.replace(".", "_")
    return run


def serve(model_config: ModelConfig | None = None, model_fixed: bool = False,
          tcp: tuple[str, int] | None = None, server_url: str | None = None, api_key: str | None = None,
          cache_reuse: int = 0) -> None:
    """Run until the client exits: over stdio, or on a TCP port for one client."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")  # stderr: stdout is the protocol
    server = build_server(model_config, model_fixed=model_fixed, server_url=server_url, api_key=api_key,
                          cache_reuse=cache_reuse)
    try:
        if tcp is not None:
            server.start_tcp(*tcp)
            return
        stdin = CheckedInput(sys.stdin.buffer)
        server.start_io(stdin=stdin)
    finally:
        server.stop_engine()
    if stdin.error is not None:  # exit with status 1 and say why, so the editor restarts the server
        raise CodespecError(f"the LSP stream is corrupt, so the server stopped: {stdin.error}")
