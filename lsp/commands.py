"""Refactoring commands: code actions on a selection -> workspace/executeCommand -> workspace/applyEdit.

The model gets the selection in a chat prompt with the task, and its answer is primed with an opening code
fence, so the output is the new code and ends at the closing fence. The original selection's tokens go to the
engine as the reference of the edit-aligned drafter: most of a rewrite repeats the selection, and those runs
are drafted in long pieces. Progress (tokens/s, acceptance) goes to the client with window/workDoneProgress,
which the user can cancel, as can $/cancelRequest.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing

from lsprotocol import types
from pygls.exceptions import JsonRpcContentModified, JsonRpcException, JsonRpcInvalidParams

from codespec.context import treesitter

from .backend import RewriteRequest
from .protocol import COMMANDS, COMMANDS_BY_ID
from .documents import clean_text
from .settings import spec_config

REPORT_SECONDS = 0.25  # progress reports at most this often


def code_actions(server, params: types.CodeActionParams) -> list[types.CodeAction]:
    """One code action per command when the selection is not empty."""
    document = server.document(params.text_document.uri)
    start = server.offset(document, params.range.start.line, params.range.start.character)
    end = server.offset(document, params.range.end.line, params.range.end.character)
    only = params.context.only if params.context is not None else None
    if end <= start or (only and not any(types.CodeActionKind.RefactorRewrite.value.startswith(kind)
                                         for kind in only)):
        return []
    selection = {"uri": params.text_document.uri, "range": server.converter.unstructure(params.range)}
    return [types.CodeAction(title=command.title, kind=types.CodeActionKind.RefactorRewrite,
                             command=types.Command(title=command.title, command=command.id, arguments=[selection]))
            for command in COMMANDS]


def parse_arguments(command, arguments) -> dict:
    """The command's single object argument, checked against its declared fields."""
    if not arguments or len(arguments) != 1 or not isinstance(arguments[0], dict):
        names = ", ".join(argument.name for argument in command.arguments)
        raise JsonRpcInvalidParams(f"{command.id} takes one object argument with the fields {names}")
    given = arguments[0]
    values = {}
    for argument in command.arguments:
        value = given.get(argument.name)
        if argument.name == "range":
            values["range"] = parse_range(value)
        elif not isinstance(value, str) or not value.strip():
            raise JsonRpcInvalidParams(f"{command.id}: {argument.name!r} must be a non-empty string ({argument.doc})")
        else:
            # the instruction and language go into the prompt; the uri only names the document
            values[argument.name] = value if argument.name == "uri" else clean_text(value)
    return values


def parse_range(value) -> tuple[int, int, int, int]:
    try:
        start, end = value["start"], value["end"]
        numbers = (start["line"], start["character"], end["line"], end["character"])
    except (TypeError, KeyError):
        raise JsonRpcInvalidParams("'range' must be an LSP Range: {start: {line, character}, end: {...}}") from None
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        raise JsonRpcInvalidParams("'range' positions must be integers")
    return numbers


def fit_to_selection(output: str, selection: str) -> str:
    """The replacement text: the model's code, with the selection's own trailing line break (or none)."""
    body = output.rstrip("\r\n")
    trailing = selection[len(selection.rstrip("\r\n")):]
    return body + trailing


async def client_answer(request):
    """Await a request to the client, shielded: when $/cancelRequest cancels the command meanwhile, the request
    itself stays pending, so the client's late answer finds it (pygls reports an answer to a cancelled request
    as a server error, shown to the user)."""
    return await asyncio.shield(request)


def progress_message(stats, characters: int = 0) -> str:
    if stats is None:  # a remote server's statistics come at the end
        return f"{characters} characters" if characters else "prefilling"
    return (f"{stats.generated_tokens} tokens, {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.tokens_per_forward:.2f} tok/forward, acceptance {stats.acceptance_rate:.0%}")


class Progress:
    """window/workDoneProgress for one command, when the client supports it; cancellable."""

    def __init__(self, server, title: str):
        self.server, self.title = server, title
        self.token: str | None = None
        self.last_report = 0.0

    async def begin(self, on_cancel) -> None:
        window = self.server.client_capabilities.window
        if window is None or not window.work_done_progress:
            return
        token = f"codespec-{uuid.uuid4()}"
        await client_answer(self.server.work_done_progress.create_async(token))
        self.token = token
        self.server.work_done_progress.begin(token, types.WorkDoneProgressBegin(
            title=self.title, cancellable=True, message="prefilling"))
        # the client's window/workDoneProgress/cancel cancels this future (pygls)
        self.server.work_done_progress.tokens[token].add_done_callback(
            lambda future: on_cancel() if future.cancelled() else None)

    def report(self, stats, characters: int = 0) -> None:
        now = time.monotonic()
        if self.token is None or now - self.last_report < REPORT_SECONDS:
            return
        self.last_report = now
        self.server.work_done_progress.report(self.token, types.WorkDoneProgressReport(
            message=progress_message(stats, characters), cancellable=True))

    def end(self, message: str) -> None:
        if self.token is None:
            return
        self.server.work_done_progress.end(self.token, types.WorkDoneProgressEnd(message=message))
        future = self.server.work_done_progress.tokens.pop(self.token, None)
        if future is not None and not future.done():
            future.set_result(None)
        self.token = None


async def execute(server, command_id: str, arguments) -> dict:
    """Run a refactoring command and send its edit. Returns {"applied": bool, "cancelled": bool, "stats": ...}."""
    command = COMMANDS_BY_ID[command_id]
    values = parse_arguments(command, arguments)
    document = server.document(values["uri"])
    start_line, start_character, end_line, end_character = values["range"]
    start = server.offset(document, start_line, start_character)
    end = server.offset(document, end_line, end_character)
    if end <= start:
        raise JsonRpcInvalidParams(f"{command.id} needs a selection; the range is empty")
    if len(document.text) > server.settings.max_file_chars:
        raise JsonRpcInvalidParams(f"the document is larger than max_file_chars ({server.settings.max_file_chars})")
    selection, version = document.text[start:end], document.version
    language = treesitter.language_id_for(document.language_id, document.uri) or ""
    settings = server.settings
    request = RewriteRequest(f"lsp-command:{document.uri}", command.id, values, selection, language,
                             settings.command_max_tokens, spec_config(settings, command=True))
    task, generating, cancelled = asyncio.current_task(), False, False

    def cancel() -> None:  # the progress's cancel button: stop generating (once the edit is sent, it is too late)
        nonlocal cancelled
        if generating and not cancelled:
            cancelled = True
            task.cancel()

    progress = Progress(server, command.title)
    text, stats, finished = "", None, False
    try:
        await progress.begin(cancel)
        generating = True
        # leaving this block (an error, a cancelled task) stops the generation: a cancelled job, a closed stream
        async with aclosing(server.backend.rewrite(request)) as pieces:
            async for piece in pieces:
                text += piece.text
                stats = piece.stats or stats
                finished = finished or piece.final
                progress.report(stats, len(text))
    except asyncio.CancelledError:
        if not cancelled:  # $/cancelRequest
            progress.end("cancelled")
            raise
        task.uncancel()  # the progress's cancel: answered below
    except JsonRpcException as exc:
        progress.end(f"failed: {exc.message}")
        raise
    finally:
        generating = False
    if cancelled or not finished:  # a job cancelled from elsewhere ends without a result
        progress.end("cancelled")
        return {"applied": False, "cancelled": True, "stats": None}
    server.send_stats(command.id, stats)
    if document.version != version or server.documents.open.get(document.uri) is not document:
        progress.end("the document changed; nothing applied")
        raise JsonRpcContentModified("the document changed while the command ran; run it again")
    if not text.strip():  # an empty answer would delete the selection
        progress.end("the model wrote nothing; nothing applied")
        return {"applied": False, "cancelled": False, "stats": server.stats_params(command.id, stats)}
    new_text = fit_to_selection(text, selection)
    edit_range = types.Range(start=types.Position(line=start_line, character=start_character),
                             end=types.Position(line=end_line, character=end_character))
    try:
        result = await client_answer(server.workspace_apply_edit_async(types.ApplyWorkspaceEditParams(
            edit=workspace_edit(server, document, edit_range, new_text, version), label=command.title)))
    except asyncio.CancelledError:  # $/cancelRequest while the client applies the edit: it may still apply it
        progress.end("cancelled")
        raise
    progress.end(progress_message(stats))
    return {"applied": bool(result.applied), "cancelled": False, "stats": server.stats_params(command.id, stats)}


def workspace_edit(server, document, edit_range: types.Range, new_text: str, version: int) -> types.WorkspaceEdit:
    """A versioned edit when the client takes one (it then refuses an edit to a changed document)."""
    text_edit = types.TextEdit(range=edit_range, new_text=new_text)
    workspace = server.client_capabilities.workspace
    edits = workspace.workspace_edit if workspace is not None else None
    if edits is not None and edits.document_changes:
        identifier = types.OptionalVersionedTextDocumentIdentifier(uri=document.uri, version=version)
        return types.WorkspaceEdit(document_changes=[types.TextDocumentEdit(text_document=identifier,
                                                                            edits=[text_edit])])
    return types.WorkspaceEdit(changes={document.uri: [text_edit]})
