"""Tree-sitter around the cursor: one line or a block, the enclosing scopes, where a block ends."""

from codespec.context import treesitter
from codespec.context.treesitter import Syntax, analyze, grammar

SOURCE = '''import os


class Shape:
    """A shape."""

    def area(self) -> float:
        total = 0.0
        for side in self.sides:
            total += side
        
        return total

    def name(self):
        return "shape"  # a comment
'''


def at(marker_line: int, column: int, source: str = SOURCE, language: str | None = "python"):
    tree = Syntax(grammar(language)).tree(source.encode()) if language else None
    return analyze(source, marker_line, column, tree)


def test_python_grammar_is_installed():
    assert grammar("python") is not None
    assert grammar("no-such-language") is None


def test_empty_line_in_a_body_is_a_block_inside_the_method_and_class():
    context = at(10, 8)  # the whitespace-only line inside area()
    assert context.multiline and context.block_indent == 8
    assert [(s.kind, s.name) for s in context.scopes] == [("class", "Shape"), ("function", "area")]
    assert context.scopes[1].header == "def area(self) -> float:"


def test_a_line_that_opens_a_block_is_a_block_one_level_deeper():
    context = at(8, len("        for side in self.sides:"))
    assert context.multiline and context.block_indent == 12
    assert context.reason == "opens a block"


def test_text_after_the_cursor_means_one_line():
    context = at(7, len("        total = "))
    assert not context.multiline and context.reason == "text after the cursor"


def test_closing_brackets_after_the_cursor_still_allow_a_block():
    source = "def f(x):\n    return g(\n"
    context = at(1, len("    return g("), source + ")")
    assert context.reason != "text after the cursor"


def test_inside_a_comment_or_string_is_one_line():
    assert at(14, len('        return "shape"  # a comment')).reason == "inside a string or comment"
    assert at(14, len('        return "sha')).multiline is False
    source = 'def f():\n    s = """text\n    more\n'
    assert at(2, len("    more"), source).reason == "inside a string or comment"


def test_a_dict_colon_does_not_open_a_block():
    source = "config = {\n    'a':\n"
    context = at(1, len("    'a':"), source)
    assert not context.multiline


def test_mid_statement_is_one_line():
    source = "def f(a):\n    return g(a, "
    context = at(1, len("    return g(a, "), source)
    assert not context.multiline and context.reason == "inside a statement"


def test_without_a_grammar_indentation_still_decides():
    context = at(10, 8, language=None)
    assert context.multiline and context.block_indent == 8 and context.scopes == ()
    assert at(8, len("        for side in self.sides:"), language=None).multiline


def test_other_languages_when_their_grammar_is_installed():
    source = "class A {\n  run(a) {\n    \n  }\n}\nfunction f(a) {\n  return 'x'; // done\n}\n"
    context = at(2, 4, source, "javascript")  # a test dependency: tree-sitter-javascript
    assert context.multiline and [(s.kind, s.name) for s in context.scopes] == [("class", "A"), ("function", "run")]
    assert at(5, len("function f(a) {"), source, "javascript").block_indent == 2
    assert at(6, len("  return 'x'; // done"), source, "javascript").reason == "inside a string or comment"


def test_a_language_without_a_grammar_degrades_to_indentation():
    assert grammar("cobol") is None
    source = "PROCEDURE DIVISION.\n    \n"
    context = analyze(source, 1, 4, None)
    assert context.multiline and context.block_indent == 4


def test_incremental_reparse_matches_a_fresh_parse():
    syntax = Syntax(grammar("python"))
    before = SOURCE.encode()
    syntax.tree(before)
    # replace "total" on line 7 (bytes 8..13 of that line) with "subtotal_value"
    line_start = before.index(b"        total = 0.0")
    start, old_end = line_start + 8, line_start + 13
    after = before[:start] + b"subtotal_value" + before[old_end:]
    syntax.edit(start, old_end, start + 14, (7, 8), (7, 13), (7, 22))
    incremental = syntax.tree(after)
    fresh = Syntax(grammar("python")).tree(after)
    assert str(incremental.root_node) == str(fresh.root_node)
    assert b"subtotal_value" in incremental.root_node.text


def test_language_from_the_file_name():
    assert treesitter.language_id_for(None, "file:///a/b.py") == "python"
    assert treesitter.language_id_for("rust", "x.py") == "rust"
    assert treesitter.language_id_for(None, "x.unknown") is None
