"""Completions at the cursor: textDocument/inlineCompletion, and textDocument/completion for clients without it.

Typing latency is the whole game, so a request:
1. waits out the debounce, and gives up if a newer request for the same document arrived meanwhile (the
   newer one also cancels this one's generation, if it had started);
2. asks tree-sitter whether to write one line or a block, before any model time is spent;
3. builds a prompt whose start stays put while the user types (fim_prompts.py: the prefix window starts at a
   line that only moves when the window overflows, and the chunks from other files are only re-picked when those
   files or the enclosing scope change), so the document's session reuses its KV cache and a keystroke costs the
   prefill of the few tokens that changed;
4. streams through the request layer's output filter (codespec.request), which stops the generation as soon as
   the block ends or the text runs into the code after the cursor.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from codespec.context import treesitter
from codespec.context.fim import SuffixTrimmer
from codespec.request import BlockLimit

from .ahead import AcceptAhead
from .backend import Unavailable
from .documents import Document, Documents
from .fim_prompts import CHARS_PER_TOKEN, InfillPrompts, InfillRequest, PrefixWindow, filename_of
from .protocol import Settings
from .settings import spec_config

SETTLED_SECONDS = 1.0  # a document feeds the shared pool once it has not been edited for this long
SINGLE_LINE_TOKENS = 48  # a one-line completion needs no more


@dataclass
class Completion:
    text: str
    line: int  # the LSP position it goes at
    character: int
    context: treesitter.CursorContext
    stats: object | None  # GenerationStats


def session_id(uri: str) -> str:
    return f"lsp:{uri}"


@dataclass
class Host:
    """What the Completer uses of the language server (CodespecServer makes it from its own parts): these, not
    the whole server, so what a completion touches is in sight."""

    documents: Documents
    settings: Callable[[], Settings]  # the settings now: a configuration change replaces them
    backend: object  # LocalBackend or RemoteBackend: infill(InfillRequest) streams the pieces
    prompts: InfillPrompts  # the other files' chunks kept per document, shared with the backend that picks them
    document: Callable[[str], Document]  # the open document, else a JSON-RPC InvalidParams error
    offset: Callable[[Document, int, int], int]  # an LSP position's offset, else InvalidParams
    ready_to_generate: Callable[[], Awaitable[None]]
    send_stats: Callable[..., None]  # (kind, stats, precomputed=False): the codespec/stats notification
    report_unavailable: Callable[[Exception | None], None]  # a busy or unreachable server, or None once it answered


class Completer:
    def __init__(self, host: Host):
        self.host = host
        self.latest: dict[str, int] = {}  # uri -> number of the newest request
        self.tasks: dict[str, tuple[int, asyncio.Task]] = {}  # uri -> (number, task) of the request in flight
        self.window = PrefixWindow()
        self._numbers = itertools.count(1)
        self.ahead = AcceptAhead(self.suggest)

    def forget(self, uri: str) -> None:
        """The document closed: cancel its completion and drop what was kept for the next keystroke."""
        self.latest.pop(uri, None)
        self.cancel(uri)
        self.window.forget(uri)
        self.host.prompts.forget(uri)
        self.ahead.drop(uri)

    def is_current(self, uri: str, number: int) -> bool:
        return self.latest.get(uri) == number

    def cancel(self, uri: str) -> None:
        """Cancel the document's request in flight: its generation stops (a cancelled job, a closed HTTP
        stream), and it answers with an empty result (complete)."""
        stale = self.tasks.pop(uri, None)
        if stale is not None:
            stale[1].cancel()

    async def complete(self, uri: str, line: int, character: int, invoked: bool = False) -> Completion | None:
        """The completion at an LSP position, or None (superseded, a huge file, nothing worth showing).
        Raises the server's JSON-RPC errors for unknown documents and positions that do not exist."""
        host = self.host
        number = next(self._numbers)
        self.latest[uri] = number
        document = host.document(uri)
        offset = host.offset(document, line, character)
        self.cancel(uri)  # superseded: its text would land at the wrong place
        task = asyncio.current_task()
        self.tasks[uri] = (number, task)
        try:
            return await self._complete(uri, number, document, offset, line, character, invoked)
        except asyncio.CancelledError:
            if self.is_current(uri, number):  # the client cancelled it
                raise
            task.uncancel()  # superseded (or the document closed): an empty answer
            return None
        finally:
            if self.tasks.get(uri, (None,))[0] == number:
                del self.tasks[uri]

    async def _complete(self, uri: str, number: int, document: Document, offset: int, line: int, character: int,
                        invoked: bool) -> Completion | None:
        host, settings = self.host, self.host.settings()
        version, text = document.version, document.text
        if len(text) > settings.max_file_chars:
            return None
        ahead = await self.ahead.take(document, offset)  # the user accepted the suggestion: its follow-up is ready
        if ahead is not None:
            suggestion, stats, context = ahead
            host.send_stats("completion", stats, precomputed=True)
            if not suggestion.strip():
                return None
            completion = Completion(suggestion, line, character, context, stats)
            self.ahead.start(document, offset, completion)
            return completion
        if settings.debounce_ms and not invoked:
            await asyncio.sleep(settings.debounce_ms / 1000)
        if not self.is_current(uri, number):
            return None
        await host.ready_to_generate()
        if not self.is_current(uri, number) or uri not in host.documents.open:
            return None
        if document.version != version:  # typed on during the debounce: the position is stale, a newer request is due
            return None
        try:
            suggested = await self.suggest(document, offset, lambda: self.is_current(uri, number))
        except Unavailable as exc:  # a busy or unreachable server: the next keystroke asks again
            host.report_unavailable(exc)
            return None
        host.report_unavailable(None)
        if suggested is None or not self.is_current(uri, number):  # superseded while generating: stopped midway
            return None
        suggestion, stats, context = suggested
        host.send_stats("completion", stats)
        if not suggestion.strip():
            return None
        completion = Completion(suggestion, line, character, context, stats)
        if document.text == text:
            self.ahead.start(document, offset, completion)
        return completion

    async def suggest(self, document: Document, offset: int, wanted) -> tuple[str, object, object] | None:
        """Generate the suggestion at `offset`: (text, stats, cursor context), or None once wanted() turns false
        (its generation is stopped)."""
        cursor_line, column = document.line_column(offset)
        context = treesitter.analyze(document.text, cursor_line, column, document.tree())
        request = self._request(document, offset, context)
        text, stats = "", None
        # the request's limits end the text (and its generation) where the block ends or the text meets the suffix;
        # leaving this block early (a cancelled task) stops the generation: a cancelled job, a closed HTTP stream
        async with aclosing(self.host.backend.infill(request)) as pieces:
            async for piece in pieces:
                stats = piece.stats or stats
                text += piece.text
                if not wanted():
                    return None
        return text.rstrip(), stats, context

    def _request(self, document: Document, offset: int, context) -> InfillRequest:
        """Snapshot, on the event loop, what the prompt is built from: documents change under us otherwise."""
        settings, documents = self.host.settings(), self.host.documents
        cursor_line = document.line_column(offset)[0]
        start_line = self.window.start(document, offset, settings.prefix_tokens * CHARS_PER_TOKEN)
        prefix = document.text[document.line_starts[start_line] : offset]
        suffix_end = offset + settings.suffix_tokens * CHARS_PER_TOKEN
        newline = document.text.rfind("\n", offset, suffix_end)
        suffix = document.text[offset : newline if newline > offset and suffix_end < len(document.text) else suffix_end]
        scopes = self.window.scopes(document, start_line)
        others = [(filename_of(d.uri), d.text) for d in documents.others(document.uri)]
        key = (tuple((d.uri, d.version) for d in documents.others(document.uri)),
               settings.extra_tokens, start_line, cursor_line // 64)
        chunks = self.host.prompts.cached_chunks(document.uri, key)
        query = prefix[-2000:] + suffix[:500]
        settled = [(d.uri, d.version, d.text) for d in documents.open.values()
                   if time.monotonic() - d.edited_at >= SETTLED_SECONDS and len(d.text) <= settings.max_file_chars]
        limit = settings.max_tokens if context.multiline else min(settings.max_tokens, SINGLE_LINE_TOKENS)
        limits = [SuffixTrimmer(suffix)] + ([BlockLimit(context.block_indent)] if context.multiline else [])
        return InfillRequest(session_id(document.uri), document.uri, prefix, suffix, scopes, others, key, chunks,
                             query, settled, limit, () if context.multiline else ("\n",), spec_config(settings),
                             limits)
