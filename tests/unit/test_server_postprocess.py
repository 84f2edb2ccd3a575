"""Where an /infill completion ends besides EOS and length: llama.cpp's n_indent, and the limits combined."""

import time

import pytest

from codespec.context.fim import SuffixTrimmer
from codespec.server.postprocess import IndentLimit, OutputFilter

INDENT_CASES = [
    # (text, n_indent, kept)
    ("x = 1\n    y = 2\nz = 3\n", 4, "x = 1\n    y = 2\n"),  # the first line is never checked
    ("x = 1\n  y = 2\n", 4, "x = 1\n  "),  # as llama.cpp: cut where the short line's content starts
    ("x = 1\n\ty = 2\n", 2, "x = 1\n\t"),  # a tab counts one column
    ("x = 1\n        y\n    z\n", 4, "x = 1\n        y\n    z\n"),
    ("x = 1\n\n    y\n", 4, "x = 1\n"),  # a blank line is indented by nothing (llama.cpp)
    ("only one line", 8, "only one line"),
]


@pytest.mark.parametrize("text, n_indent, kept", INDENT_CASES)
@pytest.mark.parametrize("piece", [1, 2, 5, 100])
def test_indent_limit_streamed_in_pieces(text, n_indent, kept, piece):
    out = OutputFilter([IndentLimit(n_indent)])
    sent = ""
    for start in range(0, len(text), piece):
        delta, stop = out.feed(text[start : start + piece])
        sent += delta
        assert kept.startswith(sent)
        if stop:
            break
    sent += out.finish()
    assert sent == kept and out.final_text == kept
    assert out.stopped == (kept != text)


def test_limits_combine_the_earliest_cut_wins():
    text = "total += 1\n  return total\n\nprint(total)\n"
    out = OutputFilter([SuffixTrimmer("\n\nprint(total)\n"), IndentLimit(4)])
    sent = "".join(out.feed(ch)[0] for ch in text) + out.finish()
    assert sent == "total += 1\n  "  # the indentation cut comes before the suffix


def test_time_limit_stops_after_a_complete_line():
    out = OutputFilter([], t_max_predict_ms=1)
    first, stop = out.feed("abc")
    assert (first, stop) == ("abc", False)  # no line finished yet: it goes on
    time.sleep(0.01)
    delta, stop = out.feed("def\nghi")
    assert stop and first + delta == "abcdef\nghi"
