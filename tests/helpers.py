"""Helpers shared by the drafter tests."""

import numpy as np

from codespec.config import SamplingParams
from codespec.decode import generate_steps
from codespec.sampling import Sampler
from codespec.stats import GenerationStats
from tests.tiny import EOS


def run_with_chain(session, chain, prompt, max_tokens, draft_max, eos_ids=frozenset({EOS})):
    """Drive a session step by step with a hand-made drafter chain; returns (steps, stats)."""
    session.use_chain(chain)
    stats = GenerationStats()
    steps = list(generate_steps(session, prompt, Sampler(SamplingParams()), draft_max, max_tokens,
                                session.path.config.max_position_embeddings, eos_ids, stats))
    return steps, stats


def array(tokens):
    return np.array(tokens, dtype=np.int64)


def begun(cls, tokens, **options):
    """A drafter of class `cls` that has begun on `tokens`."""
    drafter = cls(**options)
    drafter.begin(array(tokens), SamplingParams())
    return drafter


def draft(drafter, tokens, max_tokens=16):
    proposal = drafter.draft(array(tokens), max_tokens)
    return proposal.tokens if proposal else None





def three_turn_identity(engine, make_drafter, label, seeds=12):
    """For each seed: a generation, an extension and a regeneration from half the prompt (which cuts the
    history, so the drafter must forget) in one session; each must equal plain decoding. Returns the
    draft tokens accepted over all of it, so the caller can check speculation really happened."""
    from codespec.config import SpecConfig
    from codespec.drafters import Chain
    from tests.conftest import random_prompt

    plain_spec, params = SpecConfig(spec=("none",)), SamplingParams(max_tokens=48)
    accepted = 0
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        prompt = random_prompt(rng, int(rng.integers(20, 120)), repetitive=True)
        session = engine.session(f"{label}-{seed}")
        session.use_chain(Chain([make_drafter()]))
        first = engine.generate(prompt, params, spec=plain_spec).tokens
        extension = prompt + first + random_prompt(rng, 10, repetitive=True)
        regeneration = prompt[: len(prompt) // 2]
        for turn, plain in ((prompt, first), (extension, None), (regeneration, None)):
            steps, stats = run_with_chain(session, session.chain, turn, 48, draft_max=8)
            emitted = [t for step in steps for t in step.tokens]
            assert emitted == (plain or engine.generate(turn, params, spec=plain_spec).tokens), f"seed {seed}"
            accepted += stats.accepted_tokens
    return accepted
