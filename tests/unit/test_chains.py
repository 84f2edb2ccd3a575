"""Every drafter by name, and chains of them, through the registry: greedy output never changes."""

import numpy as np
import pytest

from codespec.config import SPEC_CHOICES, SamplingParams, SpecConfig
from codespec.drafters import build_chain
from codespec.engine import Engine
from tests.conftest import random_prompt
from tests.tiny import EOS

# adaptive off: every draft is verified whatever this machine's timing, so each drafter's drafts are put to the test
SMALL = dict(mod_n=3, mod_pool_size=1 << 16, draft_layers=1, adaptive=False)
CHAINS = [(name,) for name in SPEC_CHOICES] + [
    ("prompt-lookup", "ngram-mod", "draft"),
    ("ngram-mod", "ngram-map-k4v", "ngram-cache"),
    ("draft", "prompt-lookup"),
]


@pytest.fixture
def engine(model, tokenizer):
    """An engine whose one ngram-mod pool is small and keyed on 3 tokens, so random prompts reach it."""
    return Engine(model, tokenizer, SpecConfig(**SMALL), eos_token_ids=frozenset({EOS}))


@pytest.mark.parametrize("chain", CHAINS, ids=",".join)
def test_greedy_identity_for_every_drafter_and_chain(engine, chain):
    spec = SpecConfig(spec=chain, **SMALL)
    accepted = 0
    for seed in range(8):
        rng = np.random.default_rng(200 + seed)
        prompt = random_prompt(rng, int(rng.integers(10, 100)), repetitive=seed % 4 != 0)
        params = SamplingParams(max_tokens=40)
        plain = engine.generate(prompt, params, spec=SpecConfig(spec=("none",)))
        result = engine.generate(prompt, params, spec=spec, session_id="chain")
        assert result.tokens == plain.tokens, f"seed {seed}"
        accepted += result.stats.accepted_tokens
        assert [d.name for d in result.stats.drafters] == list(build_chain(spec, engine.shared).names)
    assert accepted > 0 or chain in (("none",), ("edit-align",))  # edit-align drafts only from a reference


def test_model_drafters_go_last(engine):
    assert build_chain(SpecConfig(spec=("draft", "prompt-lookup", "ngram-mod"), **SMALL), engine.shared).names == (
        "prompt-lookup", "ngram-mod", "draft")


def test_a_drafter_that_follows_the_reference_reaches_past_draft_max_and_no_other_does():
    from codespec.drafters.base import Drafter
    from codespec.drafters.chain import Chain

    class Asked(Drafter):
        def __init__(self, name, follows):
            self.name, self.follows_reference, self.asked = name, follows, []

        def draft(self, history, max_tokens):
            self.asked.append(max_tokens)
            return None

    follower, other = Asked("edit-align", True), Asked("ngram-mod", False)
    chain = Chain([follower, other])
    history = np.arange(10)
    for reference, reach, max_tokens, room in [(None, 64, 16, 100), ([1, 2], 64, 16, 100), ([1, 2], 64, 16, 30),
                                               ([1, 2], 64, 5, 5), ([1, 2], 0, 16, 100)]:
        chain.set_reference(reference, reach)
        chain.draft(history, max_tokens, room=room)
    assert follower.asked == [16, 64, 30, 5, 16]
    assert other.asked == [16, 16, 16, 5, 16]
