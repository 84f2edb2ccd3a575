"""Completions at the cursor: textDocument/inlineCompletion, and textDocument/completion for clients without it.

Typing latency is the whole game, so a request:
1. waits out the debounce, and gives up if a newer request for the same document arrived meanwhile (the
   newer one also cancels this one's generation, if it had started);
2. asks tree-sitter whether to write one line or a block, before any model time is spent;
3. builds a prompt whose start stays put while the user types (the prefix window starts at a line that only
   moves when the window overflows, and the chunks from other files are only re-picked when those files or the
   enclosing scope change), so the document's session reuses its KV cache and a keystroke costs the prefill of
   the few tokens that changed;
4. streams, and stops as soon as the block ends or the text runs into the code after the cursor.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

from pygls.exceptions import JsonRpcException

from codespec.config import SamplingParams
from codespec.context import extra as extra_context
from codespec.context import treesitter
from codespec.context.fim import SuffixTrimmer, fim_prompt, trim_to_suffix
from codespec.errors import CodespecError

from .documents import Document, clean_text
from .settings import spec_config

REQUEST_FAILED = -32803  # LSP's RequestFailed: valid params, but the server could not do it
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
        self.jobs: dict[str, object] = {}  # uri -> the running Job
        self.window_lines: dict[str, int] = {}  # uri -> line where the prefix window starts
        self.window_scopes: dict[str, tuple] = {}  # uri -> the scopes around that line (headers cut off above)
        self.extra_cache: dict[str, tuple] = {}  # uri -> (key, chunks)
        self._numbers = itertools.count(1)

    def forget(self, uri: str) -> None:
        """The document closed: cancel its completion and drop what was kept for the next keystroke."""
        self.latest.pop(uri, None)
        job = self.jobs.pop(uri, None)
        if job is not None:
            job.cancel()
        self.window_lines.pop(uri, None)
        self.window_scopes.pop(uri, None)
        self.extra_cache.pop(uri, None)

    def is_current(self, uri: str, number: int) -> bool:
        return self.latest.get(uri) == number

    async def complete(self, uri: str, line: int, character: int, invoked: bool = False) -> Completion | None:
        """The completion at an LSP position, or None (superseded, a huge file, nothing worth showing).
        Raises the server's JSON-RPC errors for unknown documents and positions that do not exist."""
        server, settings = self.server, self.server.settings
        number = next(self._numbers)
        self.latest[uri] = number
        document = server.document(uri)
        offset = server.offset(document, line, character)
        version = document.version
        stale = self.jobs.pop(uri, None)
        if stale is not None:
            stale.cancel()  # superseded: its text would land at the wrong place
        if len(document.text) > settings.max_file_chars:
            return None
        if settings.debounce_ms and not invoked:
            await asyncio.sleep(settings.debounce_ms / 1000)
        if not self.is_current(uri, number):
            return None
        scheduler = await server.ready()
        if not self.is_current(uri, number) or uri not in server.documents.open:
            return None
        if document.version != version:  # typed on during the debounce: the position is stale, a newer request is due
            return None

        cursor_line, column = document.line_column(offset)
        context = treesitter.analyze(document.text, cursor_line, column, document.tree())
        prompt_inputs = self._prompt_inputs(document, offset)
        prompt = await scheduler.acall(self._build_prompt, *prompt_inputs)
        if not self.is_current(uri, number):
            return None
        limit = settings.max_tokens if context.multiline else min(settings.max_tokens, SINGLE_LINE_TOKENS)
        limit = min(limit, server.context_length() - len(prompt.ids) - 1)
        if limit < 1:
            return None
        params = SamplingParams(max_tokens=limit, stop=() if context.multiline else ("\n",))
        try:
            job = scheduler.submit(prompt.ids, params, session_id=session_id(uri), spec=spec_config(settings))
        except CodespecError as exc:
            raise JsonRpcException(code=REQUEST_FAILED, message=str(exc)) from None
        self.jobs[uri] = job
        suffix = prompt_inputs[2]
        trimmer = SuffixTrimmer(suffix)
        text, stats = "", None
        try:
            async for chunk in job:
                stats = chunk.stats or stats
                text += chunk.text
                trimmer.feed(chunk.text)
                if not self.is_current(uri, number):
                    return None
                if (context.multiline and treesitter.block_end(text, context.block_indent) < len(text)) \
                        or trimmer.done:
                    break  # the rest would be cut anyway: stop paying for it
        except CodespecError as exc:  # e.g. the queue is full
            raise JsonRpcException(code=REQUEST_FAILED, message=str(exc)) from None
        finally:
            job.cancel()  # no-op when it finished; frees the engine when we stopped early or were cancelled
            if self.jobs.get(uri) is job:
                del self.jobs[uri]
        if not self.is_current(uri, number):  # superseded while generating: its job was cancelled midway
            return None
        if context.multiline:
            text = text[: treesitter.block_end(text, context.block_indent)]
        text = trim_to_suffix(text, suffix).rstrip()
        server.send_stats("completion", stats)
        return Completion(text, line, character, context, stats) if text.strip() else None

    def _prompt_inputs(self, document: Document, offset: int):
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
        return (document.uri, prefix, suffix, scopes, others, key, chunks, query, settled)

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

    def _build_prompt(self, engine, uri, prefix, suffix, scopes, others, key, chunks, query, settled):
        """On the engine's thread: feed settled documents to the shared pool, pick other files' chunks,
        tokenise."""
        settings = self.server.settings
        if "ngram-mod" in settings.spec:  # open files teach the shared pool (Engine.teach)
            for document_uri, version, text in settled:
                engine.teach(document_uri, text, version)
        tokenizer = engine.tokenizer
        if chunks is None:
            def count(text: str) -> int:
                return len(tokenizer(text, add_special_tokens=False).input_ids)

            picked = extra_context.pick_chunks(others, query, settings.extra_tokens, count,
                                               max_chars_per_file=settings.max_file_chars)
            chunks = [(chunk.filename, chunk.text) for chunk in picked]
            self.extra_cache[uri] = (key, chunks)
        extra = list(chunks)
        if scopes:  # the enclosing class/function headers above the window: where the cursor is
            extra.append((filename_of(uri), "\n".join(scope.header for scope in scopes) + "\n"))
        budget = engine.context_length - settings.max_tokens - 1
        return fim_prompt(tokenizer, prefix, suffix, extra, filename=filename_of(uri), max_tokens=budget)


def filename_of(uri: str) -> str:
    """The name the prompt gives a document (and a chunk from it): the end of its URI, which reaches the
    tokenizer, so it is cleaned of unpaired surrogates like the text."""
    return clean_text(uri.rsplit("/", 1)[-1] or uri)
