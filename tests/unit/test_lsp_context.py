"""What the language server builds prompts from: chunks of other files, a prefix window that stays put while
typing, the shared pool fed by open documents, and settings checked key by key."""

import numpy as np

from codespec.config import SpecConfig
from codespec.engine import Engine
from codespec.context.extra import pick_chunks, split_chunks
from lsp.documents import Document
from lsp.fim_prompts import PrefixWindow
from lsp.protocol import Settings
from lsp.settings import apply, section
from tests.tiny import EOS


def words(text: str) -> int:
    return len(text.split())


def test_chunks_most_like_the_query_fit_the_budget_in_a_stable_order():
    geometry = "".join(f"def area_{i}(width, height):\n    return width * height\n" for i in range(16))
    strings = "".join(f"def shout_{i}(text):\n    return text.upper()\n" for i in range(16))
    files = [("strings.py", strings), ("geometry.py", geometry)]  # most relevant file first
    chosen = pick_chunks(files, "rectangle width height", budget_tokens=150, count_tokens=words, lines_per_chunk=8)
    assert chosen and all(chunk.filename == "geometry.py" for chunk in chosen)
    assert sum(words(chunk.text) for chunk in chosen) <= 150
    assert [chunk.start_line for chunk in chosen] == sorted(chunk.start_line for chunk in chosen)
    everything = pick_chunks(files, "width text", budget_tokens=10_000, count_tokens=words, lines_per_chunk=8)
    assert [c.filename for c in everything][0] == "geometry.py"  # the most relevant file goes last
    assert [c.filename for c in everything][-1] == "strings.py"
    assert pick_chunks(files, "width", budget_tokens=0, count_tokens=words) == []
    assert pick_chunks(files, "width", 10_000, words, max_chars_per_file=100) == []  # huge files are skipped


def test_blank_runs_are_not_chunks():
    assert split_chunks("a\n\n\n\nb\n", lines_per_chunk=2) == [(0, "a\n\n"), (4, "b\n")]


def test_the_prefix_window_stays_put_while_typing():
    window = PrefixWindow()
    document = Document("file:///long.py", "".join(f"line_{i} = {i}\n" for i in range(400)))
    budget = 1200
    first = window.start(document, len(document.text), budget)
    assert first > 0 and len(document.text) - document.line_starts[first] <= budget
    document.replace(len(document.text), len(document.text), "x")  # a keystroke at the end
    assert window.start(document, len(document.text), budget) == first
    document.replace(len(document.text), len(document.text), "y = 1\n" * 100)  # far past the window
    assert window.start(document, len(document.text), budget) > first


def test_headers_cut_off_by_the_window_stay_in_the_prompt_and_stay_put():
    body = "".join(f"        step_{i} = {i}\n" for i in range(300))
    document = Document("file:///long.py", f"import os\n\n\nclass Machine:\n    def run(self):\n{body}", 0, "python")
    window = PrefixWindow()
    start = window.start(document, len(document.text), 1200)
    scopes = window.scopes(document, start)
    assert [scope.header for scope in scopes] == ["class Machine:", "def run(self):"]
    document.replace(len(document.text), len(document.text), "        x")  # typing inside run()
    assert window.start(document, len(document.text), 1200) == start
    assert window.scopes(document, start) is scopes  # not worked out again: the prompt keeps its start


def test_open_documents_teach_the_shared_pool_and_take_it_back(model, tokenizer):
    engine = Engine(model, tokenizer, SpecConfig(spec=("ngram-mod",), mod_n=4), eos_token_ids=frozenset({EOS}))
    text = "def rectangle_area(width, height):\n    return width * height\n"
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids
    def drafted(tokens):  # what any session would draft from the shared pool (a bare look: it teaches the pool nothing,
        # where a drafter's draft() first learns its own history)
        return engine.shared.pool.draft(np.asarray(tokens, dtype=np.int64), 8)

    engine.teach("file:///a.py", text, 1)
    assert drafted(ids[:6]) == ids[6:14]  # drafts come from the open file
    edited = text.replace("width * height", "height * width")
    engine.teach("file:///a.py", edited, 2)
    new_ids = engine.tokenizer(edited, add_special_tokens=False).input_ids
    cut = next(i for i, (a, b) in enumerate(zip(ids, new_ids)) if a != b)
    assert drafted(new_ids[:cut])[: len(new_ids) - cut] == new_ids[cut:cut + 8]  # the edit replaced the old text
    engine.forget_document("file:///a.py")
    assert drafted(new_ids[:6]) == []  # closed and forgotten: nothing left in the pool


def test_settings_are_checked_key_by_key():
    settings, problems = apply(Settings(), {"draftMax": 8, "max-tokens": 64, "spec": ["prompt-lookup", "nope"],
                                            "debounce_ms": -5, "prefix_tokens": True, "colour": "blue"})
    assert settings.draft_max == 8 and settings.max_tokens == 64
    assert settings.spec == Settings().spec and settings.debounce_ms == Settings().debounce_ms
    assert settings.prefix_tokens == Settings().prefix_tokens
    assert len(problems) == 4 and any("nope" in p for p in problems) and any("colour" in p for p in problems)
    assert section({"codespec": {"max_tokens": 3}}) == {"max_tokens": 3}
    assert section({"maxTokens": 3}) == {"maxTokens": 3}  # a client that sends the section's contents
    assert section({"python": {}}) is None and section(None) is None


def test_a_bad_tcp_address_is_a_one_line_error(capsys):
    from codespec.cli import main

    assert main(["lsp", "--tcp", "localhost"]) == 1
    assert capsys.readouterr().err.strip() == "codespec: error: --tcp wants HOST:PORT, got 'localhost'"
