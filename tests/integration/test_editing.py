"""What an editor's requests need from the engine on the default model: a suggestion on an empty line starts with
its indentation (token healing), and a window that slides down reuses the cache (--cache-reuse)."""

import textwrap
from pathlib import Path

import pytest

from codespec.config import SamplingParams, SpecConfig
from codespec.context.fim import fim_prompt

pytestmark = pytest.mark.integration

POINT = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __eq__(self, other):\n"


def test_a_suggestion_on_an_empty_line_starts_with_its_indentation_not_blank_lines(default_engine):
    """The prefix ends with the bare newline of the cursor's empty line. Unhealed, the model does not start with
    the indentation: it writes another newline first (the suggestion would insert a blank line) or leaves the
    method altogether (with the default's rounding it opens a code fence); healed, its first token is
    newline-plus-indentation and the suggestion starts with the indentation. Speculative and plain decoding of the
    healed prompt agree."""
    engine = default_engine
    params = SamplingParams(max_tokens=24)
    suffix = "\n        return NotImplemented\n"
    unhealed = fim_prompt(engine.tokenizer, POINT, suffix)
    unhealed_text = engine.generate(unhealed.ids, params).text
    print("unhealed suggestion:", repr(unhealed_text))
    assert not unhealed_text.startswith("        ")
    healed = fim_prompt(engine.tokenizer, POINT, suffix, vocabulary=engine.vocabulary)
    plain = engine.generate(healed.ids, params, spec=SpecConfig(spec=("none",)), healed=healed.healed)
    print("healed suggestion:", repr(plain.text))
    assert plain.text.startswith("        ") and not plain.text.startswith("\n")
    speculative = engine.generate(healed.ids, params, healed=healed.healed, session_id="healed")
    assert speculative.tokens == plain.tokens


def window(lines, start, end):
    return "".join(lines[start:end])


def test_a_window_that_slides_down_reuses_the_cache_and_speculation_stays_exact_over_it(default_engine):
    """llama.vim's prefix window over real code (textwrap.py), slid down by 1 to 3 lines as a suggestion is accepted:
    with --cache-reuse the lines still in the window are moved, not computed again (>= 90% of the prompt). Moving is
    an approximation (the moved lines keep what they saw of the dropped ones): the test prints where the output
    first differs from a cold prefill's, which it often does on this small model. What stays exact is speculation:
    speculative decoding over the reused cache gives plain decoding's tokens over the same cache. So each session
    starts alone, with no other session to borrow chunks from: a chunk borrowed from another session's cache was computed in
    another context, and with activations rounded to 8 bits that difference showed (a CI run: the speculative
    session, which could borrow from the plain one, parted from it at token 8)."""
    engine = default_engine
    lines = Path(textwrap.__file__).read_text().splitlines(keepends=True)
    params = SamplingParams(max_tokens=24)
    plain_spec = SpecConfig(spec=("none",))
    try:
        for cursor, slide in ((300, 1), (340, 2), (380, 3)):
            before = fim_prompt(engine.tokenizer, window(lines, cursor - 100, cursor), "")
            after = fim_prompt(engine.tokenizer, window(lines, cursor - 100 + slide, cursor + slide), "")
            engine.cache_reuse = 64
            results = {}
            for name, spec in (("plain", plain_spec), ("speculative", None)):
                for info in engine.sessions_info():  # each name starts alone, from a cold prefill of `before`
                    engine.drop(info.id, pool="keep")
                engine.generate(before.ids, params, session_id=name, spec=spec)
                results[name] = engine.generate(after.ids, params, session_id=name, spec=spec)
            engine.cache_reuse = 0
            cold = engine.generate(after.ids, params, session_id=f"cold-{cursor}", spec=plain_spec)
            moved = results["plain"]
            share = moved.stats.cached_tokens / len(after.ids)
            same = next((k for k, (a, b) in enumerate(zip(moved.tokens, cold.tokens)) if a != b), len(cold.tokens))
            print(f"slide {slide}: {moved.stats.cached_tokens} of {len(after.ids)} prompt tokens reused ({share:.0%}); "
                  f"the first {same} of {len(cold.tokens)} tokens equal a cold prefill's")
            assert share >= 0.9
            assert results["speculative"].tokens == moved.tokens
            assert results["speculative"].stats.cached_tokens == moved.stats.cached_tokens
    finally:
        engine.cache_reuse = 0
        for info in engine.sessions_info():
            engine.drop(info.id, pool="keep")
