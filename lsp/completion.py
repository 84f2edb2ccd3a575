"""Completions at the cursor: textDocument/inlineCompletion, and textDocument/completion for clients without it.

Typing latency is the whole game, so a request:
1. waits out the debounce, and gives up if a newer request for the same document arrived meanwhile (the
   newer one also cancels this one's generation, if it had started);
2. asks tree-sitter whether to write one line or a block, before any model time is spent;
3. builds a prompt whose start stays put while the user types (the prefix window starts at a line that only
   moves when the window overflows, and the chunks from other files are only re-picked when those files or the
   enclosing scope change), so the document's session reuses its KV cache and a keystroke costs the prefill of
   the few tokens that changed;
4. streams through the request layer's output filter (codespec.request), which stops the generation as soon as
   the block ends or the text runs into the code after the cursor.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import aclosing
from dataclasses import dataclass

from codespec.context import extra as extra_context
from codespec.context import treesitter
from codespec.context.fim import SuffixTrimmer, fim_prompt, prompt_budget
from codespec.request import BlockLimit

from .backend import REQUEST_FAILED, InfillRequest, Unavailable  # noqa: F401 (REQUEST_FAILED: imported here too)
from .ahead import AcceptAhead
from .documents import Document, clean_text
from .settings import spec_config

CHARS_PER_TOKEN = 3  # a cautious average for code: budgets in tokens become windows in characters
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


class Completer:
    def __init__(self, server):
        self.server = server
        self.latest: dict[str, int] = {}  # uri -> number of the newest request
        self.tasks: dict[str, tuple[int, asyncio.Task]] = {}  # uri -> (number, task) of the request in flight
        self.window_lines: dict[str, int] = {}  # uri -> line where the prefix window starts
        self.window_scopes: dict[str, tuple] = {}  # uri -> the scopes around that line (headers cut off above)
        self.extra_cache: dict[str, tuple] = {}  # uri -> (key, chunks)
        self._numbers = itertools.count(1)
        self.ahead = AcceptAhead(self)

    def forget(self, uri: str) -> None:
        """The document closed: cancel its completion and drop what was kept for the next keystroke."""
        self.latest.pop(uri, None)
        self.cancel(uri)
        self.window_lines.pop(uri, None)
        self.window_scopes.pop(uri, None)
        self.extra_cache.pop(uri, None)
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
        server = self.server
        number = next(self._numbers)
        self.latest[uri] = number
        document = server.document(uri)
        offset = server.offset(document, line, character)
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
        server, settings = self.server, self.server.settings
        version, text = document.version, document.text
        if len(text) > settings.max_file_chars:
            return None
        ahead = await self.ahead.take(document, offset)  # the user accepted the suggestion: its follow-up is ready
        if ahead is not None:
            suggestion, stats, context = ahead
            server.send_stats("completion", stats, precomputed=True)
            if not suggestion.strip():
                return None
            completion = Completion(suggestion, line, character, context, stats)
            self.ahead.start(document, offset, completion)
            return completion
        if settings.debounce_ms and not invoked:
            await asyncio.sleep(settings.debounce_ms / 1000)
        if not self.is_current(uri, number):
            return None
        await server.ready_to_generate()
        if not self.is_current(uri, number) or uri not in server.documents.open:
            return None
        if document.version != version:  # typed on during the debounce: the position is stale, a newer request is due
            return None
        try:
            suggested = await self.suggest(document, offset, lambda: self.is_current(uri, number))
        except Unavailable as exc:  # a busy or unreachable server: the next keystroke asks again
            server.report_unavailable(exc)
            return None
        server.report_unavailable(None)
        if suggested is None or not self.is_current(uri, number):  # superseded while generating: stopped midway
            return None
        suggestion, stats, context = suggested
        server.send_stats("completion", stats)
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
        async with aclosing(self.server.backend.infill(request)) as pieces:
            async for piece in pieces:
                stats = piece.stats or stats
                text += piece.text
                if not wanted():
                    return None
        return text.rstrip(), stats, context

    def _request(self, document: Document, offset: int, context) -> InfillRequest:
        """Snapshot, on the event loop, what the prompt is built from: documents change under us otherwise."""
        settings = self.server.settings
        cursor_line = document.line_column(offset)[0]
        start_line = self._window_start(document, offset, settings.prefix_tokens * CHARS_PER_TOKEN)
        prefix = document.text[document.line_starts[start_line] : offset]
        suffix_end = offset + settings.suffix_tokens * CHARS_PER_TOKEN
        newline = document.text.rfind("\n", offset, suffix_end)
        suffix = document.text[offset : newline if newline > offset and suffix_end < len(document.text) else suffix_end]
        scopes = self._window_scopes(document, start_line)
        others = [(filename_of(d.uri), d.text) for d in self.server.documents.others(document.uri)]
        key = (tuple((d.uri, d.version) for d in self.server.documents.others(document.uri)),
               settings.extra_tokens, start_line, cursor_line // 64)
        cached = self.extra_cache.get(document.uri)
        chunks = cached[1] if cached is not None and cached[0] == key else None
        query = prefix[-2000:] + suffix[:500]
        settled = [(d.uri, d.version, d.text) for d in self.server.documents.open.values()
                   if time.monotonic() - d.edited_at >= SETTLED_SECONDS and len(d.text) <= settings.max_file_chars]
        limit = settings.max_tokens if context.multiline else min(settings.max_tokens, SINGLE_LINE_TOKENS)
        limits = [SuffixTrimmer(suffix)] + ([BlockLimit(context.block_indent)] if context.multiline else [])
        return InfillRequest(session_id(document.uri), document.uri, prefix, suffix, scopes, others, key, chunks,
                             query, settled, limit, () if context.multiline else ("\n",), spec_config(settings),
                             limits)

    def _window_start(self, document: Document, offset: int, budget_chars: int) -> int:
        """The line where the prefix window starts: kept from the last request while the window still fits,
        else moved down to leave a quarter of the budget to grow into."""
        cursor_line = document.line_column(offset)[0]
        previous = self.window_lines.get(document.uri)
        starts = document.line_starts
        if previous is not None and previous <= cursor_line and offset - starts[previous] <= budget_chars:
            return previous
        target = max(0, offset - budget_chars * 3 // 4)
        line = next((n for n in range(cursor_line + 1) if starts[n] >= target), cursor_line)
        self.window_lines[document.uri] = line
        return line

    def _window_scopes(self, document: Document, start_line: int) -> tuple:
        """The classes and functions that enclose the window's first line of code and start above it: the
        window cut their headers off, so the prompt names them. Worked out when the window moves and kept
        until it moves again, like the window itself: a prompt whose start changes costs a full prefill."""
        cached = self.window_scopes.get(document.uri)
        if cached is not None and cached[0] == start_line:
            return cached[1]
        scopes = ()
        tree = document.tree()
        if tree is not None and start_line > 0:
            first = next((n for n in range(start_line, document.line_count) if document.line_text(n).strip()), None)
            if first is not None:
                text = document.line_text(first)
                column = len(text) - len(text.lstrip())
                lines = document.text.split("\n")
                scopes = tuple(scope for scope in treesitter.enclosing_scopes(tree, lines, first, column)
                               if scope.line < start_line)
        self.window_scopes[document.uri] = (start_line, scopes)
        return scopes

    def build_prompt(self, engine, request: InfillRequest):
        """On the engine's thread (in process): feed settled documents to the shared pool, pick other files'
        chunks, tokenise."""
        settings = self.server.settings
        if "ngram-mod" in settings.spec:  # open files teach the shared pool (Engine.teach)
            for document_uri, version, text in request.settled:
                engine.teach(document_uri, text, version)
        tokenizer = engine.tokenizer

        def count(text: str) -> int:
            return len(tokenizer(text, add_special_tokens=False).input_ids)

        extra = self.extra_chunks(request, count)
        # the budget of the longest completion, not this one's: a prompt that shrank for a block would not reuse the
        # cache of one cut for a line
        budget = prompt_budget(engine.context_length, settings.max_tokens)
        return fim_prompt(tokenizer, request.prefix, request.suffix, extra, filename=filename_of(request.uri),
                          max_tokens=budget, vocabulary=engine.vocabulary)  # healed at the cursor, as /infill is

    def extra_chunks(self, request: InfillRequest, count) -> list[tuple[str, str]]:
        """(filename, text) of the other files' chunks, picked with `count` (text -> tokens) unless the ones
        picked for the same window and files are at hand, then the enclosing scopes' headers."""
        settings = self.server.settings
        chunks = request.chunks
        if chunks is None:
            picked = extra_context.pick_chunks(request.others, request.query, settings.extra_tokens, count,
                                               max_chars_per_file=settings.max_file_chars)
            chunks = [(chunk.filename, chunk.text) for chunk in picked]
            self.extra_cache[request.uri] = (request.extra_key, chunks)
        extra = list(chunks)
        if request.scopes:  # the enclosing class/function headers above the window: where the cursor is
            extra.append((filename_of(request.uri), "\n".join(scope.header for scope in request.scopes) + "\n"))
        return extra


def filename_of(uri: str) -> str:
    """The name the prompt gives a document (and a chunk from it): the end of its URI, which reaches the
    tokenizer, so it is cleaned of unpaired surrogates like the text."""
    return clean_text(uri.rsplit("/", 1)[-1] or uri)
