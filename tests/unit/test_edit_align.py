"""The edit-aligned drafter: follows the output through the reference, re-synchronises after insertions,
deletions and substitutions, and never changes greedy output."""

import numpy as np
import pytest

from codespec.config import SamplingParams, SpecConfig
from codespec.drafters import build_chain
from codespec.drafters.base import Draft, Drafter
from codespec.drafters.chain import Chain
from codespec.drafters.edit_align import CONFIRMED, EditAlign
from tests.conftest import random_prompt
from tests.helpers import array

PROMPT = [7, 8, 9]
REFERENCE = list(range(100, 140))  # 40 distinct tokens: every n-gram occurs once


def started(reference=REFERENCE, prompt=PROMPT):
    drafter = EditAlign()
    drafter.set_reference(reference)
    drafter.begin(array(prompt), SamplingParams())
    return drafter


def emit(drafter, history, tokens, drafted=0, accepted=0):
    """Append tokens to the history as a decode step would, and tell the drafter."""
    history = history + list(tokens)
    drafter.accept(array(history), drafted, accepted)
    return history


def proposal(drafter, history, max_tokens=8):
    draft = drafter.draft(array(history), max_tokens)
    return draft.tokens if draft else None


def test_drafts_the_reference_from_the_start_and_follows_the_output():
    drafter = started()
    assert proposal(drafter, PROMPT) == REFERENCE[:8]
    history = emit(drafter, PROMPT, REFERENCE[:6], drafted=8, accepted=5)
    assert proposal(drafter, history, 4) == REFERENCE[6:10]


def test_resynchronises_after_an_insertion():
    drafter = started()
    history = emit(drafter, PROMPT, REFERENCE[:10] + [1, 2, 3])  # the rewrite inserts three new tokens
    assert proposal(drafter, history) is None  # lost: the inserted text is not in the reference
    history = emit(drafter, history, REFERENCE[10:12])  # back on the original text
    assert proposal(drafter, history) == REFERENCE[12:20]


def test_resynchronises_after_a_deletion():
    drafter = started()
    history = emit(drafter, PROMPT, REFERENCE[:10] + REFERENCE[15:17])  # five tokens dropped
    assert proposal(drafter, history) == REFERENCE[17:25]


def test_a_single_substituted_token_is_skipped_near_the_pointer():
    drafter = started()
    history = emit(drafter, PROMPT, REFERENCE[:10] + [1])  # token 10 renamed
    assert proposal(drafter, history) is None
    history = emit(drafter, history, REFERENCE[11:12])  # one token back on the original: enough near the pointer
    assert proposal(drafter, history) == REFERENCE[12:20]


def test_prefers_the_occurrence_after_the_last_aligned_point():
    motif = [50, 51, 52]
    reference = motif + list(range(200, 210)) + motif + list(range(300, 310))
    drafter = started(reference)
    history = emit(drafter, PROMPT, reference[:14] + [1, 2] + motif)  # past the first motif, then an insertion
    assert proposal(drafter, history) == list(range(300, 308))  # the second motif, not the first


def test_without_a_reference_it_drafts_nothing():
    drafter = started(reference=None)
    assert proposal(drafter, PROMPT) is None
    drafter.set_reference([1, 2, 3])
    drafter.set_reference(None)
    drafter.begin(array(PROMPT), SamplingParams())
    assert proposal(drafter, PROMPT) is None


def test_truncation_re_finds_the_place():
    drafter = started()
    history = emit(drafter, PROMPT, REFERENCE[:12])
    history = history[: len(PROMPT) + 6]  # the session cut back six output tokens
    drafter.truncate(len(history))
    assert proposal(drafter, history, 4) == REFERENCE[6:10]
    drafter.truncate(1)  # even the prompt was cut: the output starts over
    assert proposal(drafter, [7], 4) == REFERENCE[:4]


def test_registered_and_chainable():
    chain = build_chain(SpecConfig(spec=("edit-align", "ngram-mod", "prompt-lookup")))
    assert chain.names == ("edit-align", "ngram-mod", "prompt-lookup")


def edited(tokens: list[int], rng) -> list[int]:
    """A copy with a few insertions, deletions and substitutions, like a small rewrite."""
    out = list(tokens)
    for _ in range(3):
        at = int(rng.integers(0, max(len(out) - 1, 1)))
        kind = rng.integers(0, 3)
        if kind == 0:
            out[at:at] = rng.integers(1, 384, size=3).tolist()
        elif kind == 1:
            del out[at : at + 2]
        else:
            out[at] = int(rng.integers(1, 384))
    return out


@pytest.mark.parametrize("chain", [("edit-align",), ("edit-align", "ngram-mod", "prompt-lookup")])
def test_greedy_output_is_identical_with_and_without_the_drafter(engine, chain):
    params = SamplingParams(max_tokens=64)
    accepted = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        prompt = random_prompt(rng, int(rng.integers(10, 60)), repetitive=bool(seed % 2))
        plain = engine.generate(prompt, params, spec=SpecConfig(spec=("none",))).tokens
        for reference in (edited(plain, rng), rng.integers(1, 384, size=40).tolist()):
            result = engine.generate(prompt, params, spec=SpecConfig(spec=chain, draft_max=8),
                                     session_id=f"edit-{seed}", reference=reference)
            assert result.tokens == plain, f"seed {seed}"
            accepted += next(d.acc_tokens for d in result.stats.drafters if d.name == "edit-align")
        # the same session again without a reference: edit-align must not draft the old one
        again = engine.generate(prompt, params, spec=SpecConfig(spec=chain, draft_max=8), session_id=f"edit-{seed}")
        assert again.tokens == plain
        assert next(d.gen_tokens for d in again.stats.drafters if d.name == "edit-align") == 0
    assert accepted > 100  # the near-copies were really drafted from the reference


def test_after_re_finding_its_place_it_is_tentative_until_the_output_has_followed_the_reference_a_while():
    drafter = started(reference=list(range(100, 200)))
    assert not drafter.draft(array(PROMPT), 8).tentative  # from the start: trusted
    history = emit(drafter, PROMPT, [100, 101, 55, 102, 103])  # an insertion: lost, then re-found
    draft = drafter.draft(array(history), 8)
    assert draft.tokens[0] == 104 and draft.tentative
    history = emit(drafter, history, range(104, 104 + CONFIRMED - 1))
    assert drafter.draft(array(history), 8).tentative
    history = emit(drafter, history, [104 + CONFIRMED - 1])
    assert not drafter.draft(array(history), 8).tentative


class Fixed(Drafter):
    def __init__(self, name, draft):
        self.name, self.proposal = name, draft

    def draft(self, history, max_tokens):
        return self.proposal


def test_a_tentative_draft_is_verified_only_when_no_drafter_after_it_drafts():
    unsure, sure = Draft([1, 2, 3], tentative=True), Draft([4, 5])
    chain = Chain([Fixed("unsure", unsure), Fixed("sure", sure)])
    assert chain.draft(array(PROMPT), 8) is sure and chain.last == "sure"
    chain = Chain([Fixed("unsure", unsure), Fixed("nothing", None)])
    assert chain.draft(array(PROMPT), 8) is unsure and chain.last == "unsure"
    chain.accept(array(PROMPT + [1, 2]), 3, 1)
    assert chain.stats[0].gen_tokens == 3 and chain.stats[0].acc_tokens == 1


def test_the_pairs_shortcut_re_finds_the_place_a_full_search_finds():
    """An output whose last two tokens are no adjacent pair of the reference skips the searches for n-grams of 2 or
    more (none can match): on random references and outputs over a small vocabulary (many repeats), the place re-found
    is the one a plain search over every n finds (longest first; one token only within 8 after the anchor; the
    nearest occurrence at or after the anchor, else the last)."""
    def searched(reference, output, anchor):
        for n in range(min(6, len(output)), 0, -1):
            ends = [e for e in range(n - 1, len(reference)) if reference[e - n + 1 : e + 1] == output[-n:]]
            ends = [e for e in ends if anchor <= e < anchor + 8] if n == 1 else ends
            if ends:
                return ([e for e in ends if e >= anchor] or ends[-1:])[0] + 1
        return None

    rng = np.random.default_rng(5)
    for _ in range(300):
        reference = rng.integers(0, 6, size=int(rng.integers(1, 40))).tolist()
        output = rng.integers(0, 6, size=int(rng.integers(1, 12))).tolist()
        anchor = int(rng.integers(0, len(reference) + 1))
        drafter = EditAlign()
        drafter.set_reference(reference)
        drafter.anchor = anchor
        assert drafter._resync(array(output)) == searched(reference, output, anchor)
