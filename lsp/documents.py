"""Open documents: text kept in sync from incremental edits, positions in UTF-16 code units, and what the
completion context needs to know (when each was last edited, its parse tree).

pygls keeps a copy of each document too, but its position conversion clamps bad positions instead of
rejecting them and it does not expose the text before each edit, which tree-sitter's incremental reparse
needs; so the server reads documents from here.
"""

from __future__ import annotations

import bisect
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from codespec.context import treesitter

LINE_BREAK = re.compile(r"\r\n|\r|\n")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a str from JSON holds surrogates only when they are unpaired


class PositionError(ValueError):
    """A position or range that does not exist in the document (answered with a JSON-RPC error)."""


def clean_text(text: str) -> str:
    """Text with each unpaired UTF-16 surrogate replaced by U+FFFD. JSON can carry "\\ud800", but UTF-8, the
    tokenizer and tree-sitter cannot: one such character in one document failed every completion that read it.
    U+FFFD is one UTF-16 unit too, so the client's positions still point at the same places."""
    return LONE_SURROGATE.sub("\ufffd", text)


def utf16_length(text: str) -> int:
    return len(text) + sum(1 for char in text if ord(char) > 0xFFFF) if not text.isascii() else len(text)


@dataclass
class Document:
    uri: str
    text: str
    version: int = 0
    language_id: str | None = None
    edited_at: float = field(default_factory=time.monotonic)
    syntax: treesitter.Syntax | None = None

    def __post_init__(self):
        self.text = clean_text(self.text)
        self.language_id = clean_text(self.language_id) if self.language_id else self.language_id
        self._line_starts: list[int] | None = None
        language = treesitter.grammar(treesitter.language_id_for(self.language_id, self.uri))
        self.syntax = treesitter.Syntax(language) if language is not None else None

    # --- lines and positions -------------------------------------------------------------------------
    @property
    def line_starts(self) -> list[int]:
        """Offset (code points) where each line starts; a final line after the last break always exists."""
        if self._line_starts is None:
            self._line_starts = [0] + [match.end() for match in LINE_BREAK.finditer(self.text)]
        return self._line_starts

    @property
    def line_count(self) -> int:
        return len(self.line_starts)

    def line_text(self, line: int) -> str:
        """The line's text without its line break."""
        starts = self.line_starts
        end = starts[line + 1] if line + 1 < len(starts) else len(self.text)
        return self.text[starts[line] : end].rstrip("\r\n")

    def offset(self, line: int, character: int, clamp: bool = False) -> int:
        """The code-point offset of an LSP position (character in UTF-16 code units). A line or character
        past the end is a PositionError, or with `clamp` is moved to the nearest end."""
        if line < 0 or character < 0:
            if not clamp:
                raise PositionError(f"negative position {line}:{character}")
            line, character = max(line, 0), max(character, 0)
        if line >= self.line_count:
            if not clamp:
                raise PositionError(f"line {line} is past the end of the document ({self.line_count} lines)")
            return len(self.text)
        text = self.line_text(line)
        column, units = (character, character) if text.isascii() else (0, 0)
        while units < character and column < len(text):  # walk UTF-16 code units
            units += 2 if ord(text[column]) > 0xFFFF else 1
            column += 1
        if units > character:
            column -= 1  # inside a surrogate pair: round down
        if units < character or column > len(text):
            if not clamp:
                raise PositionError(f"character {character} is past the end of line {line} "
                                    f"({utf16_length(text)} UTF-16 units)")
            column = len(text)
        return self.line_starts[line] + column

    def position(self, offset: int) -> tuple[int, int]:
        """The LSP (line, UTF-16 character) of a code-point offset."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self.line_starts, offset) - 1
        return line, utf16_length(self.text[self.line_starts[line] : offset])

    def line_column(self, offset: int) -> tuple[int, int]:
        """(line, column in code points) of an offset, as treesitter.analyze expects."""
        line = bisect.bisect_right(self.line_starts, offset) - 1
        return line, offset - self.line_starts[line]

    # --- edits ---------------------------------------------------------------------------------------
    def replace(self, start: int, end: int, new_text: str) -> None:
        """Replace text[start:end], telling the parse tree where (tree-sitter points are in bytes)."""
        old, new_text = self.text, clean_text(new_text)
        if self.syntax is not None:
            start_point = self._byte_point(old, start)
            old_end_point = self._byte_point(old, end)
            start_byte = len(old[:start].encode("utf-8"))
            old_end_byte = start_byte + len(old[start:end].encode("utf-8"))
            inserted = new_text.encode("utf-8")
            new_lines = inserted.split(b"\n")
            new_end_point = ((start_point[0] + len(new_lines) - 1, len(new_lines[-1])) if len(new_lines) > 1
                             else (start_point[0], start_point[1] + len(inserted)))
            self.syntax.edit(start_byte, old_end_byte, start_byte + len(inserted), start_point, old_end_point,
                             new_end_point)
        self.text = old[:start] + new_text + old[end:]
        self._line_starts = None
        self.edited_at = time.monotonic()

    def _byte_point(self, text: str, offset: int) -> tuple[int, int]:
        line = bisect.bisect_right(self.line_starts, offset) - 1
        return line, len(text[self.line_starts[line] : offset].encode("utf-8"))

    def tree(self):
        """The current parse tree, or None without a grammar for this language."""
        return self.syntax.tree(self.text.encode("utf-8")) if self.syntax is not None else None


class Documents:
    """Open documents by URI, plus the last few closed ones that were edited (still useful context)."""

    def __init__(self, keep_closed: int = 8):
        self.open: dict[str, Document] = {}
        self.closed: OrderedDict[str, Document] = OrderedDict()
        self.keep_closed = keep_closed

    def get(self, uri: str) -> Document:
        document = self.open.get(uri)
        if document is None:
            raise KeyError(f"unknown document {uri}: it was never opened (textDocument/didOpen)")
        return document

    def did_open(self, uri: str, text: str, version: int = 0, language_id: str | None = None) -> Document:
        self.closed.pop(uri, None)
        document = Document(uri, text, version, language_id)
        self.open[uri] = document
        return document

    def did_change(self, uri: str, version: int, changes) -> Document:
        """Apply content changes in order: each has `range` and `text`, or only `text` (the whole
        document). Ranges past the end are clamped: a notification cannot answer with an error."""
        document = self.get(uri)
        for change in changes:
            change_range = getattr(change, "range", None)
            if change_range is None:
                document.replace(0, len(document.text), change.text)
                continue
            start = document.offset(change_range.start.line, change_range.start.character, clamp=True)
            end = document.offset(change_range.end.line, change_range.end.character, clamp=True)
            document.replace(min(start, end), max(start, end), change.text)
        document.version = version
        return document

    def did_close(self, uri: str) -> Document | None:
        """Returns a document that fell out of the recently-closed list (its context is dropped)."""
        document = self.open.pop(uri, None)
        if document is None:
            return None
        document.syntax = None  # the tree is only needed while it is edited
        self.closed[uri] = document
        if len(self.closed) > self.keep_closed:
            return self.closed.popitem(last=False)[1]
        return None

    def others(self, uri: str) -> list[Document]:
        """Every other open and recently closed document, most recently edited first."""
        documents = [d for u, d in self.open.items() if u != uri] + [d for u, d in self.closed.items() if u != uri]
        return sorted(documents, key=lambda d: d.edited_at, reverse=True)
