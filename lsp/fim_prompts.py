"""The completions' prompts: what a completion at the cursor is built from, and building it. Below both backends
(LocalBackend builds the FIM prompt here on the engine's thread, RemoteBackend sends its parts to a codespec
server), so the request goes one way: completion.py prepares an InfillRequest, a backend turns it into text.

A prompt's start must stay put while the user types, or every keystroke pays a full prefill: the prefix window
starts at a line that only moves when the window overflows (PrefixWindow), and the other files' chunks are only
picked again when those files, the window or the enclosing scope change (InfillPrompts.extra_chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from codespec.config import SpecConfig
from codespec.context import extra as extra_context
from codespec.context import treesitter
from codespec.context.fim import FimPrompt, fim_prompt, prompt_budget

from .documents import Document, clean_text
from .protocol import Settings

CHARS_PER_TOKEN = 3  # a cautious average for code: budgets in tokens become windows in characters


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
    limits: list = field(default_factory=list)  # output limits (codespec.request.limits): the block's end, the suffix


def filename_of(uri: str) -> str:
    """The name the prompt gives a document (and a chunk from it): the end of its URI, which reaches the
    tokenizer, so it is cleaned of unpaired surrogates like the text."""
    return clean_text(uri.rsplit("/", 1)[-1] or uri)


class InfillPrompts:
    """The other files' chunks and the FIM prompt for an InfillRequest, with the chunks picked for each document
    kept for the next keystroke. One is shared by the Completer (which looks the kept chunks up when it prepares
    a request) and the backend (which picks and keeps them)."""

    def __init__(self, settings: Callable[[], Settings]):
        self.settings = settings  # read when the prompt is built, as the settings are then
        self.extra_cache: dict[str, tuple] = {}  # uri -> (key, chunks)

    def cached_chunks(self, uri: str, key: tuple) -> list | None:
        """The chunks picked for the document while `key` held, or None: they are picked again."""
        cached = self.extra_cache.get(uri)
        return cached[1] if cached is not None and cached[0] == key else None

    def forget(self, uri: str) -> None:
        self.extra_cache.pop(uri, None)

    def extra_chunks(self, request: InfillRequest, count) -> list[tuple[str, str]]:
        """(filename, text) of the other files' chunks, picked with `count` (text -> tokens) unless the ones
        picked for the same window and files are at hand, then the enclosing scopes' headers."""
        settings = self.settings()
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

    def build(self, engine, request: InfillRequest) -> FimPrompt:
        """On the engine's thread (in process): feed settled documents to the shared pool, pick other files'
        chunks, tokenise."""
        settings = self.settings()
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


class PrefixWindow:
    """Where each document's prefix window starts, and the scopes its start cut off: kept from keystroke to
    keystroke, so the prompt's start (and the session's KV cache) stays put."""

    def __init__(self):
        self.lines: dict[str, int] = {}  # uri -> line where the prefix window starts
        self.kept_scopes: dict[str, tuple] = {}  # uri -> (that line, the scopes around it: headers cut off above)

    def forget(self, uri: str) -> None:
        self.lines.pop(uri, None)
        self.kept_scopes.pop(uri, None)

    def start(self, document: Document, offset: int, budget_chars: int) -> int:
        """The line where the prefix window starts: kept from the last request while the window still fits,
        else moved down to leave a quarter of the budget to grow into."""
        cursor_line = document.line_column(offset)[0]
        previous = self.lines.get(document.uri)
        starts = document.line_starts
        if previous is not None and previous <= cursor_line and offset - starts[previous] <= budget_chars:
            return previous
        target = max(0, offset - budget_chars * 3 // 4)
        line = next((n for n in range(cursor_line + 1) if starts[n] >= target), cursor_line)
        self.lines[document.uri] = line
        return line

    def scopes(self, document: Document, start_line: int) -> tuple:
        """The classes and functions that enclose the window's first line of code and start above it: the
        window cut their headers off, so the prompt names them. Worked out when the window moves and kept
        until it moves again, like the window itself: a prompt whose start changes costs a full prefill."""
        cached = self.kept_scopes.get(document.uri)
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
        self.kept_scopes[document.uri] = (start_line, scopes)
        return scopes
