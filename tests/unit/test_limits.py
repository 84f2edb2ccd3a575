"""Where a completion's text ends besides EOS, n_predict and stop strings (codespec.request.limits): the one block
limit under llama.cpp's rule (/infill's n_indent) and the editor's (the LSP's tree-sitter block), the suffix, the
time limit, and the output filter that combines them; golden cases, each streamed in pieces of every size."""

import time

import pytest

from codespec.context.fim import SuffixTrimmer, prompt_budget
from codespec.request.limits import EDITOR, LLAMA_CPP, BlockLimit, OutputFilter, TimeLimit, apply_limits

INDENT_CASES = [
    # (text, n_indent, kept): llama.cpp's n_indent
    ("x = 1\n    y = 2\nz = 3\n", 4, "x = 1\n    y = 2\n"),  # the first line is never checked
    ("x = 1\n  y = 2\n", 4, "x = 1\n  "),  # as llama.cpp: cut where the short line's content starts
    ("x = 1\n\ty = 2\n", 2, "x = 1\n\t"),  # a tab counts one column
    ("x = 1\n        y\n    z\n", 4, "x = 1\n        y\n    z\n"),
    ("x = 1\n\n    y\n", 4, "x = 1\n"),  # a blank line is indented by nothing (llama.cpp)
    ("x = 1\n  ", 4, "x = 1\n  "),  # a last line of indentation only is never judged
    ("only one line", 8, "only one line"),
]

BLOCK_CASES = [
    # (text, block indent, kept): an editor's block (the LSP: tree-sitter's block indent)
    ("x = 1\n        y = 2\n\n        return y\n    def other(self):\n        pass", 8,
     "x = 1\n        y = 2\n\n        return y"),  # blank lines stay inside; the cut goes before the line break
    ("def f():\n    return 1\n\n\ndef g():\n    pass", 0, "def f():\n    return 1\n"),  # two blank lines at the top
    ("a\nb", 0, "a\nb"),
    ("a\n\nb\n", 0, "a\n\nb\n"),  # one blank line at the top level does not end it
    ("if x:\n\ty = 1\n  z = 2\n", 4, "if x:\n\ty = 1"),  # a tab goes to the next tab stop (4): 2 spaces leave
    ("x\n    y\n  ", 4, "x\n    y\n  "),  # a last line of whitespace at the end: blank, inside
    ("x\n        y\n    \n    z", 8, "x\n        y\n    "),
    ("x\r\n        y\r\n    z\r\n", 8, "x\r\n        y\r"),  # CRLF: the cut goes before the line feed
]


def streamed(text: str, limits, piece: int) -> tuple[str, OutputFilter]:
    """The text through an OutputFilter in pieces; checks that nothing sent is ever taken back."""
    out = OutputFilter(limits)
    sent = ""
    for start in range(0, len(text), piece):
        delta, stop = out.feed(text[start : start + piece])
        sent += delta
        if stop:
            break
    sent += out.finish()
    return sent, out


@pytest.mark.parametrize("text, n_indent, kept", INDENT_CASES)
@pytest.mark.parametrize("piece", [1, 2, 5, 100])
def test_llama_cpp_n_indent_streamed_in_pieces(text, n_indent, kept, piece):
    sent, out = streamed(text, [BlockLimit(n_indent, LLAMA_CPP)], piece)
    assert sent == kept and out.final_text == kept
    assert out.stopped == (kept != text)


@pytest.mark.parametrize("text, indent, kept", BLOCK_CASES)
@pytest.mark.parametrize("piece", [1, 3, 100])
def test_the_editor_block_streamed_in_pieces(text, indent, kept, piece):
    sent, out = streamed(text, [BlockLimit(indent, EDITOR)], piece)
    assert sent == kept == apply_limits(text, [BlockLimit(indent)])


@pytest.mark.parametrize("text, indent, kept", BLOCK_CASES)
def test_every_prefix_sends_only_what_the_whole_text_keeps(text, indent, kept):
    """A cut found on part of the text never lands before one found on all of it (nothing sent is taken back)."""
    for end in range(len(text) + 1):
        out = OutputFilter([BlockLimit(indent)])
        sent, stop = out.feed(text[:end])
        assert kept.startswith(sent), (end, sent)


def test_one_blank_line_streamed_is_not_yet_two():
    """The LSP cut "a\\n\\n" as the end of a top-level block before it knew whether a second blank line followed."""
    out = OutputFilter([BlockLimit(0)])
    assert out.feed("a\n\n") == ("a\n", False)
    assert out.feed("b\n") == ("\nb", False)  # its line break waits: a blank line may follow it
    assert out.finish() == "\n" and not out.stopped


def test_limits_combine_the_earliest_cut_wins():
    text = "total += 1\n  return total\n\nprint(total)\n"
    out = OutputFilter([SuffixTrimmer("\n\nprint(total)\n"), BlockLimit(4, LLAMA_CPP)])
    sent = "".join(out.feed(ch)[0] for ch in text) + out.finish()
    assert sent == "total += 1\n  "  # the indentation cut comes before the suffix


def test_a_cut_text_is_judged_final_by_every_limit():
    """The block ends at 'def other', and the suffix's anchor is the block's last line: both apply."""
    text = "    x = 1\n    return x\ndef other():\n"
    assert apply_limits(text, [SuffixTrimmer("\n    return x\n"), BlockLimit(4)]) == "    x = 1"
    assert apply_limits(text, [BlockLimit(4), SuffixTrimmer("\n    return x\n")]) == "    x = 1"


def test_time_limit_stops_after_a_complete_line():
    out = OutputFilter([TimeLimit(1)])
    first, stop = out.feed("abc")
    assert (first, stop) == ("abc", False)  # no line finished yet: it goes on
    time.sleep(0.01)
    delta, stop = out.feed("def\n  ghi")
    assert stop and first + delta == "abcdef\n  " and out.stopped  # the line break and its indentation


def test_time_limit_waits_for_a_line_break_after_the_time_as_llama_cpp_does():
    """llama.cpp checks the time only when a new token holds a line break: a line that was still being written when
    the time ran out is finished first, so the text never ends half-way through a line."""
    out = OutputFilter([TimeLimit(1)])
    out.feed("x = 1\ny")
    time.sleep(0.01)
    assert out.feed(" = 2") == (" = 2", False)  # the time is up, but this line is not done
    delta, stop = out.feed("\n    z = 3\n")  # a step of several tokens: it ends at the first line break
    assert stop and out.text == "x = 1\ny = 2\n    "


def test_time_limit_does_not_call_a_finished_text_limited():
    out = OutputFilter([TimeLimit(1)])
    out.feed("a")
    time.sleep(0.01)
    assert out.finish() == "" and not out.stopped  # ended by itself (EOS) after the time: not "limit"


@pytest.mark.parametrize("context, max_tokens, limited, budget", [
    (2048, 128, True, 2048 - 128 - 1),  # room for the output and one token
    (2048, 1500, True, 1024),  # never less than half the context
    (2048, 2048, False, 2048 - 256 - 1),  # no limit asked for: a little room, the output ends at the context
    (2048, 64, False, 2048 - 64 - 1),  # a server's --n-predict below that room
    (2048, 0, False, 2047),  # a warm-up generates nothing
])
def test_one_prompt_budget(context, max_tokens, limited, budget):
    assert prompt_budget(context, max_tokens, limited) == budget
