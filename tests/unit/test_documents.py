"""Documents: UTF-16 positions, strict checks, incremental edits that keep the parse tree current."""

from types import SimpleNamespace

import pytest
from lsprotocol import types

from codespec.context.treesitter import Syntax, grammar
from lsp.documents import Document, Documents, PositionError


def change(start, end, text):
    return types.TextDocumentContentChangePartial(
        range=types.Range(start=types.Position(*start), end=types.Position(*end)), text=text)


def test_utf16_positions_count_surrogate_pairs_as_two():
    document = Document("file:///a.py", "x = '😀é'\nnext\n")
    # 'x', ' ', '=', ' ', "'", 😀 (2 units), 'é', "'" -> 9 UTF-16 units, 8 code points
    assert document.offset(0, 5) == 5
    assert document.offset(0, 7) == 6  # after the emoji
    assert document.offset(0, 6) == 5  # inside the surrogate pair: rounds down
    assert document.offset(0, 9) == 8  # end of the line
    assert document.offset(1, 0) == 9
    assert document.position(8) == (0, 9)
    assert document.position(6) == (0, 7)


@pytest.mark.parametrize("line, character", [(0, 10), (1, 5), (3, 0), (-1, 0), (0, -1)])
def test_positions_past_the_end_are_errors(line, character):
    document = Document("file:///a.py", "x = '😀é'\nnext\n")  # lines 0, 1 and an empty line 2
    with pytest.raises(PositionError):
        document.offset(line, character)


def test_clamped_positions_move_to_the_nearest_end():
    document = Document("file:///a.py", "ab\ncd")
    assert document.offset(0, 99, clamp=True) == 2
    assert document.offset(9, 0, clamp=True) == 5


def test_crlf_and_cr_line_breaks():
    document = Document("file:///a.py", "ab\r\ncd\ref")
    assert document.line_count == 3
    assert document.line_text(0) == "ab"
    assert document.offset(1, 2) == 6
    assert document.offset(2, 0) == 7
    with pytest.raises(PositionError):
        document.offset(0, 3)  # the \r\n is not part of the line


def test_incremental_changes_apply_in_order():
    documents = Documents()
    documents.did_open("file:///a.py", "def f():\n    return 1\n", 1, "python")
    documents.did_change("file:///a.py", 2, [
        change((1, 11), (1, 12), "42"),  # return 42
        change((0, 4), (0, 5), "answer"),  # def answer():
        change((2, 0), (2, 0), "\nprint(answer())\n"),  # append at the very end
    ])
    document = documents.get("file:///a.py")
    assert document.text == "def answer():\n    return 42\n\nprint(answer())\n"
    assert document.version == 2
    documents.did_change("file:///a.py", 3, [SimpleNamespace(text="whole new text")])  # a full replacement
    assert document.text == "whole new text"


def test_incremental_edits_keep_the_parse_tree_identical_to_a_fresh_parse():
    documents = Documents()
    text = "class A:\n    def f(self):\n        return 'é😀'\n"
    documents.did_open("file:///a.py", text, 1, "python")
    document = documents.get("file:///a.py")
    document.tree()  # parsed once; the edits below go through tree.edit and a reparse that reuses it
    documents.did_change("file:///a.py", 2, [
        change((2, 20), (2, 20), " + 'more'"),  # after the closing quote: 20 UTF-16 units, 19 code points
        change((1, 8), (1, 9), "g_longer"),
        change((0, 0), (0, 0), "import os\n\n"),
    ])
    fresh = Syntax(grammar("python")).tree(document.text.encode())
    assert str(document.tree().root_node) == str(fresh.root_node)
    assert "g_longer" in document.text and "'é😀' + 'more'" in document.text


def test_unknown_documents_and_closing():
    documents = Documents(keep_closed=1)
    with pytest.raises(KeyError):
        documents.get("file:///nope.py")
    documents.did_open("file:///a.py", "a", 1, "python")
    documents.did_open("file:///b.py", "b", 1, "python")
    assert documents.did_close("file:///a.py") is None
    assert [d.uri for d in documents.others("file:///x.py")] == ["file:///b.py", "file:///a.py"]
    dropped = documents.did_close("file:///b.py")  # a falls out of the recently-closed list
    assert dropped is not None and dropped.uri == "file:///a.py"
    with pytest.raises(KeyError):
        documents.get("file:///b.py")
    assert documents.did_close("file:///never-opened.py") is None


def test_others_are_most_recently_edited_first():
    documents = Documents()
    for name in "abc":
        documents.did_open(f"file:///{name}.py", name, 1, "python")
    documents.did_change("file:///a.py", 2, [change((0, 1), (0, 1), "!")])
    assert [d.uri for d in documents.others("file:///c.py")] == ["file:///a.py", "file:///b.py"]
