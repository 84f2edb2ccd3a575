"""Where the language server's generations run: the backend interface the completion and command code calls.

The language server keeps everything that is the editor's (documents, tree-sitter, prompt windows, other files'
chunks, commands, progress, statistics) and asks a backend for text: "fill in the middle here for session X" or
"rewrite this selection", streamed as pieces. Two backends:

- `LocalBackend` (this module): the model in this process, behind codespec's scheduler (`codespec lsp`);
- `RemoteBackend` (remote.py): a codespec HTTP server's /infill and /v1/chat/completions (`codespec lsp --server`).

Both build their prompts from the request with the modules below them (fim_prompts.py for completions, prompts.py
for commands): a backend never calls back into the completion or command code that asked it.

A generation is an async iterator of `Piece`s; the caller stops it by leaving the iteration (`aclosing`) or by
cancelling its task, and either way the backend frees the engine (a cancelled job, a closed HTTP stream).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams

from codespec.config import SamplingParams, SpecConfig
from codespec.errors import CodespecError
from codespec.request import OutputFilter, Prompt, Request, Requests
from codespec.scheduler import QueueFull

from .fim_prompts import InfillPrompts, InfillRequest
from .prompts import FENCE, build_prompt

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
    """The model in this process, through the request layer (codespec.request): prompts are built on the engine's
    thread, jobs run on its scheduler, the request's limits end the text there."""

    def __init__(self, ready, prompts: InfillPrompts):
        """ready(): the scheduler, once the model is loaded (an awaitable; its errors are the request's);
        prompts: builds a completion's prompt on the engine's thread."""
        self.ready = ready
        self.prompts = prompts

    def infill(self, request: InfillRequest) -> AsyncIterator[Piece]:
        def build(engine) -> Prompt:
            fim = self.prompts.build(engine, request)
            return Prompt(fim.ids, fim.truncated, fim.stop_ids, list(request.limits), fim.healed)

        params = SamplingParams(max_tokens=request.max_tokens, stop=request.stop)
        return self.run(Request(build, params, request.spec, request.session))

    def rewrite(self, request: RewriteRequest) -> AsyncIterator[Piece]:
        def build(engine) -> Prompt:
            ids, reference = build_prompt(engine, request.command_id, request.values, request.selection,
                                          request.language)
            return Prompt(ids, reference=reference)

        params = SamplingParams(max_tokens=request.max_tokens, stop=(FENCE,))
        return self.run(Request(build, params, request.spec, request.session))

    async def run(self, request: Request) -> AsyncIterator[Piece]:
        """Start the request and stream it; the job is cancelled however the iteration ends (a no-op once
        finished). The last piece says whether it ended by itself."""
        requests = Requests(await self.ready())
        try:
            run = await requests.start(request)
        except QueueFull as exc:
            raise JsonRpcException(code=REQUEST_FAILED, message=str(exc)) from None
        except CodespecError as exc:  # a prompt the context cannot hold (a selection too long to rewrite)
            raise JsonRpcInvalidParams(str(exc)) from None
        try:
            async with aclosing(requests.deltas(run)) as deltas:  # closed: the job is cancelled at once
                async for delta in deltas:
                    yield Piece(delta, run.stats)
        except CodespecError as exc:
            raise JsonRpcException(code=REQUEST_FAILED, message=str(exc)) from None
        yield Piece("", run.stats, final=run.finished)

    async def close(self) -> None:
        pass


async def limited(pieces: AsyncIterator[Piece], limits) -> AsyncIterator[Piece]:
    """Pieces through an output filter (a remote server does not know the editor's limits): what a limit cuts never
    comes out, and the stream ends at the cut (leaving it stops the generation)."""
    out = OutputFilter(limits)
    async with aclosing(pieces):
        async for piece in pieces:
            text, stop = out.feed(piece.text)
            if stop or piece.final:
                yield Piece(text + out.finish(), piece.stats, final=True)
                return
            if text:
                yield Piece(text, piece.stats)
