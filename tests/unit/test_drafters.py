import numpy as np

from codespec.config import SpecConfig
from codespec.drafters import Chain, Draft, Drafter, build_chain
from codespec.drafters.prompt_lookup import PromptLookup


def lookup(history, max_tokens=8, ngram_min=1, ngram_max=3):
    draft = PromptLookup(ngram_min, ngram_max).draft(np.array(history, dtype=np.int64), max_tokens)
    return draft.tokens if draft else None


def test_prompt_lookup_copies_what_followed_the_trailing_ngram():
    assert lookup([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9, 1, 2, 3]


def test_prompt_lookup_prefers_the_most_recent_occurrence():
    assert lookup([1, 2, 3, 7, 0, 1, 2, 3, 8, 0, 1, 2, 3]) == [8, 0, 1, 2, 3]


def test_prompt_lookup_prefers_the_longest_ngram():
    # (1, 2) last occurred before 8, but the 3-gram (5, 1, 2) occurred only before 7
    assert lookup([5, 1, 2, 7, 9, 1, 2, 8, 5, 1, 2]) == [7, 9, 1, 2, 8, 5, 1, 2]


def test_prompt_lookup_limits():
    assert lookup([1, 2, 3, 4, 5, 6, 1, 2], max_tokens=2) == [3, 4]
    assert lookup([1, 2, 3, 4, 9, 2], ngram_min=2) is None  # only a 1-gram matches
    assert lookup([1, 2, 3, 4, 9, 2], ngram_min=1) == [3, 4, 9, 2]
    assert lookup([7]) is None and lookup([1, 2, 3]) is None


class Scripted(Drafter):
    def __init__(self, name, tokens):
        self.name, self.tokens, self.events = name, tokens, []

    def draft(self, history, max_tokens):
        return Draft(list(self.tokens)) if self.tokens else None

    def accept(self, history, drafted, accepted):
        self.events.append(("accept", drafted, accepted))

    def truncate(self, new_len):
        self.events.append(("truncate", new_len))


def test_chain_first_non_empty_draft_wins_and_stats_follow():
    empty, short, long = Scripted("a", []), Scripted("b", [1]), Scripted("c", [4, 5, 6, 7])
    chain = Chain([empty, short, long], draft_min=2)
    history = np.arange(10)
    draft = chain.draft(history, max_tokens=3)
    assert draft.tokens == [4, 5, 6]  # b's one-token draft is under draft_min; c's is cut to max_tokens
    chain.accept(history, drafted=3, accepted=2)
    assert [s.calls for s in chain.stats] == [1, 1, 1]
    assert [(s.gen_drafts, s.gen_tokens, s.acc_drafts, s.acc_tokens) for s in chain.stats] == [
        (0, 0, 0, 0), (0, 0, 0, 0), (1, 3, 1, 2)]
    assert long.events == [("accept", 3, 2)] and short.events == [("accept", 0, 0)]
    chain.truncate(4)
    assert all(d.events[-1] == ("truncate", 4) for d in (short, long))
    assert chain.draft(history, max_tokens=1) is None  # under draft_min: nobody is asked
    assert chain.stats[0].calls == 1


def test_stats_line_has_llama_cpp_fields():
    chain = build_chain(SpecConfig(spec=("none", "prompt-lookup")))
    line = chain.stats[1].summary()
    for field in ("#calls", "#gen drafts", "#acc drafts", "#gen tokens", "#acc tokens", "dur(b,g,a)"):
        assert field in line


def reference_lookup(history, max_tokens, ngram_min, ngram_max):
    """The definition, written plainly: every window of every n, longest n first, latest match."""
    from numpy.lib.stride_tricks import sliding_window_view

    length = len(history)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        hits = np.flatnonzero((sliding_window_view(history[: length - 1], n) == history[length - n :]).all(axis=1))
        if hits.size:
            return history[hits[-1] + n : hits[-1] + n + max_tokens].tolist()
    return None


def test_prompt_lookup_equals_its_plain_definition():
    rng = np.random.default_rng(0)
    for _ in range(2000):  # small alphabets: many overlapping and repeated n-grams
        history = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 60)))
        ngram_min = int(rng.integers(1, 4))
        ngram_max = ngram_min + int(rng.integers(0, 4))
        draft = PromptLookup(ngram_min, ngram_max).draft(history, 8)
        assert (draft.tokens if draft else None) == reference_lookup(history, 8, ngram_min, ngram_max)
