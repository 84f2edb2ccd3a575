"""ngram-cache: thresholds, the three tables, forgetting, the static file format, speed, greedy identity."""

import time

import numpy as np
import pytest

from codespec.config import SamplingParams
from codespec.drafters.ngram_cache import (NgramCache, build_static_cache, load_static_cache,
                                           save_static_cache)
from tests.conftest import random_prompt
from tests.helpers import array, draft, three_turn_identity
from tests.helpers import begun as begun_any
from tests.unit.test_ngram_map import per_call_seconds


def begun(tokens, **options):
    return begun_any(NgramCache, tokens, **options)



def test_a_repeated_pattern_is_drafted_token_by_token():
    history = [5, 6, 7, 5, 6, 7, 5, 6]
    assert draft(begun(history), history, max_tokens=5) == [7, 5, 6, 7, 5]
    assert NgramCache.name == "ngram-cache"


def test_weak_evidence_ends_the_draft():
    split = [1, 5, 1, 6, 1]  # after 1: 5 and 6 once each, 50% is under the 66% a unigram needs
    assert draft(begun(split, n_max=1), split) is None
    leaning = [1, 5, 1, 5, 1, 6, 1]  # 2 of 3
    assert draft(begun(leaning, n_max=1), leaning, max_tokens=1) == [5]
    once = [3, 4, 3]  # a single sample: a unigram needs two
    assert draft(begun(once, n_max=1), once) is None


def test_the_longest_matching_ngram_decides():
    history = [7, 9, 2, 4, 1, 2, 3, 1, 2, 3, 7, 9, 2]  # after 2 mostly 3, but after 7 9 2 came 4
    assert draft(begun(history), history, max_tokens=1) == [4]
    assert draft(begun(history, n_max=1), history, max_tokens=1) == [3]


def test_generated_text_has_its_own_dynamic_table():
    prompt = [1, 5, 1, 5, 1, 5, 1]
    generated = [6, 1, 6, 1, 6, 1, 6, 1]  # after 1: 5 three times in the prompt, 6 four times generated
    drafter = begun(prompt, n_max=1)
    drafter.accept(array(prompt + generated), drafted=0, accepted=0)
    assert draft(drafter, prompt + generated, max_tokens=4) == [6, 1, 6, 1]  # 4/7 in context; 4/4 dynamic
    everything_as_prompt = begun(prompt + generated, n_max=1)
    assert draft(everything_as_prompt, prompt + generated) is None


def test_the_static_cache_drafts_what_the_session_has_not_seen():
    static = build_static_cache([[1, 2, 3, 4]] * 4)
    assert draft(begun([1, 2], static=static), [1, 2]) == [3, 4]
    assert draft(begun([1, 2]), [1, 2]) is None
    rare = build_static_cache([[1, 2, 3, 4]])  # one sample is not enough for the strict thresholds
    assert draft(begun([1, 2], static=rare), [1, 2]) is None


def test_truncate_forgets_what_only_the_removed_tokens_taught():
    history = [0, 1, 2, 8, 1, 2, 8, 1, 2]
    drafter = begun(history)
    assert draft(drafter, history, max_tokens=1) == [8]
    drafter.truncate(1)
    rewritten = [0, 1, 2, 3, 1, 2, 3, 1, 2]
    drafter.begin(array(rewritten), SamplingParams())
    assert draft(drafter, rewritten, max_tokens=1) == [3]
    assert all(8 not in counts.counts for counts in drafter.context.ngrams.values())


def tables(drafter):
    return [{ngram: counts.counts for ngram, counts in table.ngrams.items()}
            for table in (drafter.context, drafter.dynamic)]


@pytest.mark.parametrize("seed", range(5))
def test_truncate_leaves_the_state_of_a_drafter_that_never_saw_the_removed_tokens(seed):
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 4, size=300)
    drafter = begun(history[:50])
    generated = [False] * 50  # which positions came through accept
    for _ in range(30):
        if rng.random() < 0.3:
            del generated[int(rng.integers(0, len(generated) + 1)) :]
            drafter.truncate(len(generated))
        else:
            length = min(len(history), len(generated) + int(rng.integers(1, 20)))
            as_output = bool(rng.random() < 0.5)
            if as_output:
                drafter.accept(history[:length], drafted=0, accepted=0)
            else:
                drafter.begin(history[:length], SamplingParams())
            generated += [as_output] * (length - len(generated))
        fresh = NgramCache()
        for end in range(1, len(generated) + 1):  # replay the surviving positions with their origin
            fresh.sync(history[:end], generated=generated[end - 1])
        assert tables(drafter) == tables(fresh)


def test_static_cache_file_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    cache = build_static_cache([random_prompt(rng, 200, repetitive=True) for _ in range(5)], max_n=3)
    path = tmp_path / "corpus.ngrams"  # any name: nothing is appended to it
    save_static_cache(cache, path)
    loaded = load_static_cache(path)
    assert loaded == cache and loaded.max_n == 3
    assert loaded.top((cache_key := next(iter(cache.counts)))) == cache.top(cache_key)
    empty = build_static_cache([])
    save_static_cache(empty, tmp_path / "empty.npz")
    assert load_static_cache(tmp_path / "empty.npz") == empty


def test_a_corrupt_or_foreign_file_is_a_one_line_value_error(tmp_path):
    good = tmp_path / "good.npz"
    save_static_cache(build_static_cache([[1, 2, 3, 1, 2, 4]]), good)
    garbage, cut, foreign, npy = (tmp_path / name for name in ("garbage", "cut.npz", "foreign.npz", "one.npy"))
    garbage.write_bytes(b"\x00not a cache\n" * 10)
    cut.write_bytes(good.read_bytes()[:100])
    np.savez(foreign, weights=np.zeros(3))
    np.save(npy, np.zeros(3))
    for path in (garbage, cut, foreign, npy):
        with pytest.raises(ValueError, match="not a codespec n-gram cache file") as error:
            load_static_cache(path)
        assert "\n" not in str(error.value)
    with np.load(good) as archive:
        arrays = dict(archive)
    arrays["counts"] = -arrays["counts"]
    np.savez(foreign, **arrays)
    with pytest.raises(ValueError, match="non-positive counts"):
        load_static_cache(foreign)


def test_draft_and_accept_are_cheap_on_a_4k_history():
    history = array(random_prompt(np.random.default_rng(0), 4096, repetitive=True))
    static = build_static_cache([random_prompt(np.random.default_rng(1), 4096, repetitive=True)])
    started = time.perf_counter()
    NgramCache().begin(history, SamplingParams())
    begin_s = time.perf_counter() - started
    for name, drafter in (("ngram-cache", NgramCache()), ("ngram-cache+static", NgramCache(static=static))):
        draft_s, accept_s = per_call_seconds(drafter, history)
        print(f"\n{name}: begin(4096) {begin_s * 1e3:.2f} ms, draft {draft_s * 1e6:.0f} us, "
              f"accept {accept_s * 1e6:.0f} us per call")
        assert draft_s < 0.02 and accept_s < 0.02  # loose: catches a scan of the whole history, not noise


def corpus_static():
    rng = np.random.default_rng(100)
    return build_static_cache([random_prompt(rng, 300, repetitive=True) for _ in range(4)])


@pytest.mark.parametrize("with_static", [False, True])
def test_greedy_identity_on_the_tiny_model(engine, with_static):
    """Same tokens as plain decoding, through a generation, an extension and a regeneration."""
    static = corpus_static() if with_static else None
    accepted = three_turn_identity(engine, lambda: NgramCache(static=static), f"ngram-cache-{with_static}")
    assert accepted > 0  # drafts were accepted, so the identity was tested with speculation
