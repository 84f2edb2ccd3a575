"""Where the language server's generations run: the backend interface the completion and command code calls.

The language server keeps everything that is the editor's (documents, tree-sitter, prompt windows, other files'
chunks, commands, progress, statistics) and asks a backend for text: "fill in the middle here for session X" or
"rewrite this selection", streamed as pieces. Two backends:

- `LocalBackend` (this module): the model in this process, behind codespec's scheduler (`codespec lsp`);
- `RemoteBackend` (remote.py): a codespec HTTP server's /infill and /v1/chat/completions (`codespec lsp --server`).

A generation is an async iterator of `Piece`s; the caller stops it by leaving the iteration (`aclosing`) or by
cancelling its task, and either way the backend frees the engine (a cancelled job, a closed HTTP stream).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams

from codespec.config import SamplingParams, SpecConfig
from codespec.errors import CodespecError

REQUEST_FAILED = -32803  # LSP's RequestFailed: valid params, but the server could not do it


class Unavailable(JsonRpcException):
    """The server is busy, unavailable or unreachable: a completion gives an empty result, a command fails."""

    def __init__(self, message: str):
        super().__init__(code=REQUEST_FAILED, message=message)


@dataclass
class Piece:
    text: str
    stats: object | None = None  # GenerationStats (or its fields) so far; always on the final piece when known
    final: bool = False  # the generation ended by itself (a stop, the limit, the end of text): not cut off


@dataclass
class InfillRequest:
    """A completion at the cursor, as the Completer prepared it."""

    session: str  # the document's session: its KV cache follows the document from keystroke to keystroke
    uri: str
    prefix: str  # the prefix window (its start only moves when the window overflows)
    suffix: str
    scopes: tuple  # the enclosing classes/functions whose headers the window cut off
    others: list  # (filename, text) of the other open and recently closed documents
    extra_key: tuple  # what the other files' chunks were picked for (reused while it holds)
    chunks: list | None  # the chunks picked for extra_key before, or None: pick them now
    query: str  # the text around the cursor that chunks are picked for
    settled: list  # (uri, version, text) of the documents that should be in the shared pool now
    max_tokens: int
    stop: tuple[str, ...]
    spec: SpecConfig


@dataclass
class RewriteRequest:
    """A refactoring command's generation."""

    session: str
    command_id: str
    values: dict  # the command's arguments (instruction, language, ...)
    selection: str
    language: str  # tree-sitter's language id ('' when unknown)
    max_tokens: int
    spec: SpecConfig


class LocalBackend:
    """The model in this process: prompts are tokenised on the engine's thread, jobs run on its scheduler."""

    def __init__(self, server):
        self.server = server

    async def infill(self, request: InfillRequest) -> AsyncIterator[Piece]:
        scheduler = await self.server.ready()
        prompt = await scheduler.acall(self.server.completer.build_prompt, request)
        limit = min(request.max_tokens, self.server.context_length() - len(prompt.ids) - 1)
        if limit < 1:
            return
        params = SamplingParams(max_tokens=limit, stop=request.stop)
        async for piece in run_job(scheduler, prompt.ids, params, request.session, request.spec, healed=prompt.healed):
            yield piece

    async def rewrite(self, request: RewriteRequest) -> AsyncIterator[Piece]:
        from .commands import FENCE, build_prompt

        scheduler = await self.server.ready()
        ids, reference = await scheduler.acall(build_prompt, request.command_id, request.values, request.selection,
                                               request.language)
        room = self.server.context_length() - len(ids) - 1
        if room < 1:
            raise JsonRpcInvalidParams("the selection is too long for the model's context")
        params = SamplingParams(max_tokens=min(request.max_tokens, room), stop=(FENCE,))
        async for piece in run_job(scheduler, ids, params, request.session, request.spec, reference):
            yield piece

    async def close(self) -> None:
        pass


async def run_job(scheduler, ids, params, session, spec, reference=None, healed=None) -> AsyncIterator[Piece]:
    """Submit a job and stream it; the job is cancelled however the iteration ends (a no-op once finished)."""
    try:
        job = scheduler.submit(ids, params, session_id=session, spec=spec, reference=reference, healed=healed)
    except CodespecError as exc:  # e.g. the queue is full
        raise JsonRpcException(code=REQUEST_FAILED, message=str(exc)) from None
    try:
        async for chunk in job:
            yield Piece(chunk.text, chunk.stats, final=chunk.result is not None)
    except CodespecError as exc:
        raise JsonRpcException(code=REQUEST_FAILED, message=str(exc)) from None
    finally:
        job.cancel()
