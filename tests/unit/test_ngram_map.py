"""ngram-map-k / ngram-map-k4v: hits, dominance, the accepted-length cap, forgetting, speed, greedy identity."""

import time

import numpy as np
import pytest

from codespec.config import SamplingParams
from codespec.drafters.ngram_map import NgramMap, NgramMapK4V
from tests.conftest import random_prompt
from tests.helpers import array, draft, three_turn_identity
from tests.helpers import begun as begun_any



def begun(tokens, cls=NgramMap, **options):
    return begun_any(cls, tokens, **options)


def test_a_continuation_drafts_once_it_has_min_hits():
    history = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2]  # (1, 2) was followed by 3 twice
    assert draft(begun(history, n=2, m=3), history) == [3, 8, 1]  # copied from the latest occurrence
    assert draft(begun(history, n=2, m=3, min_hits=3), history) is None
    once = [1, 2, 3, 9, 1, 2]
    assert draft(begun(once, n=2, m=3), once) is None
    assert draft(begun(once, n=2, m=3, min_hits=1), once) == [3, 9, 1]
    assert draft(begun(history, n=2, m=3), history, max_tokens=2) == [3, 8]


def test_the_continuation_with_most_hits_wins():
    history = [1, 2, 5, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert draft(begun(history, n=2, m=3), history) == [3, 0, 1]
    history = [1, 2, 5, 0, 1, 2, 5, 0, 1, 2, 3, 0, 1, 2]
    assert draft(begun(history, n=2, m=3), history) == [5, 0, 1]


def test_a_cycle_drafts_from_an_occurrence_with_the_whole_continuation():
    history = [7, 1, 2, 3] * 4 + [7, 1]
    assert draft(begun(history, n=2, m=8), history) == [2, 3, 7, 1, 2, 3, 7, 1]


def key_followed_by(followers, end=(1, 2)):
    return [t for follower in followers for t in (1, 2, follower, 0)] + list(end)


def test_k4v_drafts_only_a_dominant_continuation():
    split = key_followed_by([3, 3, 5])  # 2 hits against 1: enough for k, not for k4v
    assert draft(begun(split, n=2, m=3), split) == [3, 0, 1]
    assert draft(begun(split, NgramMapK4V, n=2, m=3), split) is None
    dominant = key_followed_by([3, 3, 5, 3])  # 3 against 1
    assert draft(begun(dominant, NgramMapK4V, n=2, m=3), dominant) == [3, 0, 1]
    assert NgramMapK4V.name == "ngram-map-k4v" and NgramMap.name == "ngram-map-k"


def test_k4v_counts_continuations_beyond_the_four_it_tracks():
    tracked = key_followed_by([3] * 9 + [10, 11, 12])  # 9 against 3
    assert draft(begun(tracked, NgramMapK4V, n=2, m=3), tracked) == [3, 0, 1]
    untracked = key_followed_by([3] * 9 + [10, 11, 12, 13])  # a fifth continuation: 9 against 4
    assert draft(begun(untracked, NgramMapK4V, n=2, m=3), untracked) is None
    assert len(begun(untracked, n=2).keys[(1, 2)].continuations) == 4


def test_the_last_accepted_length_caps_the_next_draft():
    history = [1, 2, 3, 4, 5, 6] * 2 + [1, 2]
    drafter = begun(history, n=2, m=4)
    assert draft(drafter, history) == [3, 4, 5, 6]
    history += [3, 7]  # one draft token accepted, then the target's own token
    drafter.accept(array(history), drafted=4, accepted=1)
    history += [8, 1, 2]
    drafter.accept(array(history), drafted=0, accepted=0)  # another drafter's step: no cap change
    assert draft(drafter, history) == [3, 7, 8]  # capped at 1 + 2
    history += [3, 7, 8, 9]
    drafter.accept(array(history), drafted=3, accepted=3)  # all accepted: the cap is m again
    history += [1, 2]
    drafter.accept(array(history), drafted=0, accepted=0)
    assert draft(drafter, history) == [3, 7, 8, 9]


def test_truncate_undoes_a_cap_learned_past_the_cut():
    history = [1, 2, 3, 4, 5, 6] * 2 + [1, 2]
    drafter = begun(history, n=2, m=4)
    draft(drafter, history)
    drafter.accept(array(history + [3, 7]), drafted=4, accepted=1)
    continuation = drafter.keys[(1, 2)].continuations[3]
    assert continuation.cap == 3
    drafter.truncate(len(history) + 1)  # the verified draft is partly gone
    assert continuation.cap is None


def test_truncate_forgets_continuations_past_the_cut():
    history = [0, 0, 1, 2, 8, 1, 2, 8, 1, 2]
    drafter = begun(history, n=2, m=2)
    assert draft(drafter, history) == [8, 1]
    drafter.truncate(5)  # [0, 0, 1, 2, 8]: one occurrence of (1, 2) -> 8 is left
    rewritten = history[:5] + [1, 2]
    drafter.begin(array(rewritten), SamplingParams())
    assert draft(drafter, rewritten) is None
    drafter.truncate(2)
    rewritten = [0, 0, 1, 2, 3, 1, 2, 3, 1, 2]
    drafter.accept(array(rewritten), drafted=0, accepted=0)
    assert draft(drafter, rewritten) == [3, 1]


def state(drafter):
    return {key: (entry.occurrences, {first: list(c.positions) for first, c in entry.continuations.items()})
            for key, entry in drafter.keys.items()}


@pytest.mark.parametrize("seed", range(5))
def test_truncate_leaves_the_state_of_a_drafter_that_never_saw_the_removed_tokens(seed):
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 4, size=300)  # a small vocabulary: many keys with many continuations
    drafter = begun(history[:100], n=3)
    length = 100
    for _ in range(30):
        if rng.random() < 0.3:
            length = int(rng.integers(0, length + 1))
            drafter.truncate(length)
        else:
            length = min(len(history), length + int(rng.integers(1, 20)))
            drafter.accept(history[:length], drafted=0, accepted=0)
        assert state(drafter) == state(begun(history[:length], n=3))


def per_call_seconds(drafter, history, calls=200):
    """Median seconds per draft and per accept, one token appended per step as in decoding."""
    start = len(history) - calls
    drafter.begin(history[:start], SamplingParams())
    draft_times, accept_times = [], []
    for length in range(start, len(history)):
        started = time.perf_counter()
        drafter.draft(history[:length], 16)
        draft_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        drafter.accept(history[: length + 1], 0, 0)
        accept_times.append(time.perf_counter() - started)
    return float(np.median(draft_times)), float(np.median(accept_times))


@pytest.mark.parametrize("cls", [NgramMap, NgramMapK4V])
def test_draft_and_accept_are_cheap_on_a_4k_history(cls):
    history = array(random_prompt(np.random.default_rng(0), 4096, repetitive=True))
    drafter = cls()
    started = time.perf_counter()
    drafter.begin(history, SamplingParams())
    begin_s = time.perf_counter() - started
    draft_s, accept_s = per_call_seconds(cls(), history)
    print(f"\n{cls.name}: begin(4096) {begin_s * 1e3:.2f} ms, draft {draft_s * 1e6:.0f} us, "
          f"accept {accept_s * 1e6:.0f} us per call")
    assert draft_s < 0.02 and accept_s < 0.02  # loose: catches a scan of the whole history, not noise


@pytest.mark.parametrize("cls", [NgramMap, NgramMapK4V])
def test_greedy_identity_on_the_tiny_model(engine, cls):
    """Same tokens as plain decoding, through a generation, an extension and a regeneration."""
    accepted = three_turn_identity(engine, cls, cls.name)
    assert accepted > 0  # drafts were accepted, so the identity was tested with speculation
