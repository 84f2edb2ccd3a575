"""Syntax around the cursor, from tree-sitter, before any model time is spent.

- **one line or a block**: text after the cursor, a string or a comment mean one line; an empty line or a
  line that opens a block (`if x:`, `{`) means a block;
- **the enclosing function and class**, with their header lines, so the prompt can name them when the
  prefix window starts below them;
- **where a block ends**: the indentation of the block's body (CursorContext.block_indent), which the request
  layer's output limit (codespec.request.limits.BlockLimit) stops at.

Python's grammar is a dependency; other languages are used when their grammar wheel is installed
(`pip install tree-sitter-javascript`, ...). Without a grammar everything still works from indentation
alone: only strings, comments and scopes go unrecognised.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from dataclasses import dataclass
from pathlib import PurePath

# LSP languageId -> (grammar module, function returning the language pointer)
GRAMMARS = {
    "python": ("tree_sitter_python", "language"),
    "javascript": ("tree_sitter_javascript", "language"),
    "javascriptreact": ("tree_sitter_javascript", "language"),
    "typescript": ("tree_sitter_typescript", "language_typescript"),
    "typescriptreact": ("tree_sitter_typescript", "language_tsx"),
    "go": ("tree_sitter_go", "language"),
    "rust": ("tree_sitter_rust", "language"),
    "c": ("tree_sitter_c", "language"),
    "cpp": ("tree_sitter_cpp", "language"),
    "java": ("tree_sitter_java", "language"),
}
EXTENSIONS = {".py": "python", ".pyi": "python", ".js": "javascript", ".jsx": "javascriptreact",
              ".ts": "typescript", ".tsx": "typescriptreact", ".go": "go", ".rs": "rust", ".c": "c", ".h": "c",
              ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp", ".java": "java"}

# node type -> scope kind, across the grammars above
SCOPES = {
    "function_definition": "function", "function_declaration": "function", "method_definition": "function",
    "method_declaration": "function", "constructor_declaration": "function", "function_item": "function",
    "class_definition": "class", "class_declaration": "class", "interface_declaration": "class",
    "class_specifier": "class", "impl_item": "class", "trait_item": "class",
}
# a ':' under one of these does not open a block (dict entries, lambdas, slices, annotations)
NOT_BLOCK_COLON = {"pair", "dictionary", "lambda", "slice", "subscript", "typed_parameter",
                   "typed_default_parameter", "type", "assignment"}
PYTHON_BLOCK_KEYWORDS = re.compile(r"\s*(async\s+)?(def|class|if|elif|else|for|while|with|try|except|finally|"
                                   r"match|case)\b")
CLOSERS = set(")]}'\"`;,:")  # text after the cursor made only of these still allows a completion block


@functools.cache
def grammar(language_id: str | None):
    """The tree-sitter Language for an LSP languageId, or None when its grammar is not installed."""
    if language_id not in GRAMMARS:
        return None
    module_name, function = GRAMMARS[language_id]
    try:
        from tree_sitter import Language

        return Language(getattr(importlib.import_module(module_name), function)())
    except (ImportError, AttributeError, ValueError):
        return None


def language_id_for(language_id: str | None, filename: str | None) -> str | None:
    if language_id:
        return language_id
    return EXTENSIONS.get(PurePath(filename or "").suffix.lower())


class Syntax:
    """One document's parse tree, kept current with incremental edits (tree.edit, then a reparse that
    reuses the old tree)."""

    def __init__(self, language):
        from tree_sitter import Parser

        self.parser = Parser(language)
        self._tree = None
        self._stale = True

    def edit(self, start_byte: int, old_end_byte: int, new_end_byte: int, start_point: tuple[int, int],
             old_end_point: tuple[int, int], new_end_point: tuple[int, int]) -> None:
        if self._tree is not None:
            self._tree.edit(start_byte, old_end_byte, new_end_byte, start_point, old_end_point, new_end_point)
        self._stale = True

    def tree(self, source: bytes):
        if self._stale or self._tree is None:
            old = self._tree
            self._tree = self.parser.parse(source, old) if old is not None else self.parser.parse(source)
            self._stale = False
        return self._tree


@dataclass(frozen=True)
class Scope:
    kind: str  # "function" or "class"
    name: str
    line: int  # 0-based line of the header
    header: str  # the header text up to the body, e.g. "def area(self) -> float:"


@dataclass(frozen=True)
class CursorContext:
    multiline: bool  # a block completion; else one line
    block_indent: int  # a completion line indented less than this (in columns) ends the block
    scopes: tuple[Scope, ...]  # enclosing classes and functions, outermost first
    reason: str  # why one line or a block, for logs and tests


def indent_of(line: str, tab_size: int = 4) -> int:
    columns = 0
    for char in line:
        if char == " ":
            columns += 1
        elif char == "\t":
            columns += tab_size - columns % tab_size
        else:
            break
    return columns


def indent_unit(lines: list[str]) -> int:
    """The document's indentation step: the gcd of the indents seen (4 when there are none)."""
    step = 0
    for line in lines[:400]:
        if line.strip():
            step = math.gcd(step, indent_of(line))
    return step if step in (2, 3, 4, 8) else 4


def analyze(text: str, line: int, column: int, tree=None) -> CursorContext:
    """The syntax around (line, column), a position in code points; `tree` from Syntax.tree, or None."""
    lines = text.split("\n")
    current = lines[line].rstrip("\r") if line < len(lines) else ""
    before, after = current[:column], current[column:]
    scopes = enclosing_scopes(tree, lines, line, column) if tree is not None else ()
    if after.strip() and not set(after.strip()) <= CLOSERS:
        return CursorContext(False, 0, scopes, "text after the cursor")
    if tree is not None and column > 0 and in_string_or_comment(tree, lines, line, column):
        return CursorContext(False, 0, scopes, "inside a string or comment")
    if not before.strip():
        return CursorContext(True, indent_of(before), scopes, "empty line")
    if opens_block(tree, lines, line, column, before):
        return CursorContext(True, indent_of(current) + indent_unit(lines), scopes, "opens a block")
    return CursorContext(False, 0, scopes, "inside a statement")


def _point(lines: list[str], line: int, column: int) -> tuple[int, int]:
    return line, len(lines[line][:column].encode("utf-8")) if line < len(lines) else 0


def _leaf_before(tree, lines: list[str], line: int, column: int):
    """The node that holds the character just before (line, column)."""
    row, byte = _point(lines, line, column)
    return tree.root_node.descendant_for_point_range((row, max(byte - 1, 0)), (row, max(byte - 1, 0)))


def _ancestors(node):
    while node is not None:
        yield node
        node = node.parent


def in_string_or_comment(tree, lines: list[str], line: int, column: int) -> bool:
    leaf = _leaf_before(tree, lines, line, column)
    if any("string" in node.type or "comment" in node.type for node in _ancestors(leaf)):
        # the cursor right after a closing quote is outside the string
        return not (leaf.end_point == _point(lines, line, column) and leaf.type in ('"', "'", "string_end", "`"))
    return unclosed_string_before(tree, _point(lines, line, column))


@functools.cache
def _unclosed_string_query(language):
    from tree_sitter import Query

    try:  # only grammars with separate string delimiters (Python) recover an open string this way
        return Query(language, "(ERROR (string_start) @open)")
    except Exception:
        return None


def unclosed_string_before(tree, point: tuple[int, int]) -> bool:
    """A string opened before the cursor and never closed (a docstring being typed): tree-sitter recovers
    with an ERROR node that holds the opening quotes and parses the text after them as code."""
    query = _unclosed_string_query(tree.language)
    if query is None:
        return False
    from tree_sitter import QueryCursor

    cursor = QueryCursor(query)
    cursor.set_point_range((0, 0), point)
    for node in cursor.captures(tree.root_node).get("open", []):
        later = node.next_sibling
        while later is not None and later.type != "string_end":
            later = later.next_sibling
        if node.start_point < point and later is None:
            return True
    return False


def opens_block(tree, lines: list[str], line: int, column: int, before: str) -> bool:
    stripped = before.rstrip()
    if stripped.endswith("{"):
        return True
    if not stripped.endswith(":"):
        return False
    if tree is None:
        return bool(PYTHON_BLOCK_KEYWORDS.match(before))
    colon = _leaf_before(tree, lines, line, len(stripped))
    parent = colon.parent
    if parent is None or parent.type == "ERROR":  # incomplete code: judge by the keyword
        return bool(PYTHON_BLOCK_KEYWORDS.match(before))
    return parent.type not in NOT_BLOCK_COLON


def enclosing_scopes(tree, lines: list[str], line: int, column: int) -> tuple[Scope, ...]:
    """Functions and classes around the cursor. On an empty or whitespace line, tree-sitter ends the
    innermost block at its last statement, so scopes around the last code line above also count when
    the cursor is indented deeper than their header."""
    found = {}
    row, byte = _point(lines, line, column)
    for node in _ancestors(tree.root_node.descendant_for_point_range((row, byte), (row, byte))):
        if node.type in SCOPES:
            found[node.id] = node
    cursor_indent = indent_of(lines[line]) if line < len(lines) and lines[line].strip() else column
    above = next((r for r in range(min(line, len(lines)) - 1, -1, -1) if lines[r].strip()), None)
    if above is not None and not (line < len(lines) and lines[line].strip()):
        end = len(lines[above].rstrip())
        for node in _ancestors(_leaf_before(tree, lines, above, end)):
            if node.type in SCOPES and indent_of(lines[node.start_point[0]]) < cursor_indent:
                found[node.id] = node
    return tuple(_scope(node) for node in sorted(found.values(), key=lambda n: n.start_byte))


def _scope(node) -> Scope:
    name = node.child_by_field_name("name")
    body = node.child_by_field_name("body")
    end = body.start_byte if body is not None else node.end_byte
    header = node.text[: end - node.start_byte].decode("utf-8", "replace").rstrip(" \t{\n\r")
    if body is None:
        header = header.split("\n", 1)[0]
    return Scope(SCOPES[node.type], name.text.decode("utf-8", "replace") if name is not None else "",
                 node.start_point[0], header)
