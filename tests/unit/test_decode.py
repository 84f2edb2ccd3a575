"""Greedy identity, prefix reuse, cache cropping and stopping, on a tiny random model."""

import numpy as np
import pytest
import torch

from codespec.config import SamplingParams, SpecConfig
from codespec.decode import generate_steps
from codespec.drafters import Chain, Draft, Drafter
from codespec.errors import CodespecError
from codespec.sampling import Sampler
from codespec.stats import GenerationStats
from tests.conftest import random_prompt
from tests.helpers import run_with_chain
from tests.tiny import EOS, FixedContinuation

NONE = SpecConfig(spec=("none",))
LOOKUP = SpecConfig(spec=("prompt-lookup",), draft_max=16, ngram_min=1, ngram_max=3)


def hf_greedy(model, prompt, max_new_tokens, **options):
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=EOS, **options)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("seed", range(24))
def test_greedy_identity_against_plain_and_transformers(engine, model, seed):
    rng = np.random.default_rng(seed)
    prompt = random_prompt(rng, int(rng.integers(4, 120)), repetitive=seed % 3 != 0)
    params = SamplingParams(max_tokens=48)
    plain = engine.generate(prompt, params, spec=NONE)
    assert plain.stats.target_forwards == len(plain.tokens)  # one token per forward
    assert 0 < plain.stats.forward_seconds <= plain.stats.seconds and 0 <= plain.stats.overhead_share < 1
    assert plain.tokens == hf_greedy(model, prompt, 48)
    for draft_max in (1, 3, 8, 32):
        spec = SpecConfig(spec=("prompt-lookup",), draft_max=draft_max, ngram_min=1, ngram_max=3)
        fast = engine.generate(prompt, params, spec=spec)
        assert fast.tokens == plain.tokens, f"draft_max={draft_max}"
        assert fast.stats.target_forwards <= plain.stats.target_forwards
    assert hf_greedy(model, prompt, 48, prompt_lookup_num_tokens=10) == plain.tokens


def test_speculation_accepts_and_rejects(engine):
    """The identity tests above only mean something if drafts were both accepted and rejected."""
    totals = np.zeros(2)
    for seed in range(12):
        rng = np.random.default_rng(seed)
        result = engine.generate(random_prompt(rng, 80, repetitive=True), SamplingParams(max_tokens=48), spec=LOOKUP)
        totals += (result.stats.accepted_tokens, result.stats.drafted_tokens - result.stats.accepted_tokens)
    assert totals[0] > 50 and totals[1] > 50


def test_prefix_reuse_matches_cold_session(engine):
    rng = np.random.default_rng(7)
    base = random_prompt(rng, 90, repetitive=True)
    params = SamplingParams(max_tokens=32)
    first = engine.generate(base, params, session_id="editor", spec=LOOKUP)
    assert first.stats.cached_tokens == 0
    # the editor resends the prompt with a few tokens typed at the end
    extended = base + first.tokens[:5] + [11, 12]
    warm = engine.generate(extended, params, session_id="editor", spec=LOOKUP)
    cold = engine.generate(extended, params, spec=LOOKUP)
    assert warm.tokens == cold.tokens
    assert warm.stats.cached_tokens == len(base) + 5
    assert cold.stats.cached_tokens == 0
    # an edit above the cursor: the prompt diverges at position 40
    edited = base[:40] + [5, 6, 7] + base[40:]
    warm = engine.generate(edited, params, session_id="editor", spec=LOOKUP)
    assert warm.tokens == engine.generate(edited, params, spec=LOOKUP).tokens
    assert warm.stats.cached_tokens == 40


class Recorder(Drafter):
    """Records the notifications a drafter receives; drafts nothing."""

    name = "recorder"

    def __init__(self):
        self.events = []

    def begin(self, history, params):
        self.events.append(("begin", len(history)))

    def draft(self, history, max_tokens):
        return None

    def truncate(self, new_len):
        self.events.append(("truncate", new_len))


def test_history_rewrite_notifies_drafters(engine):
    session = engine.session("s")
    recorder = Recorder()
    prompt = list(range(10, 60))
    steps, _ = run_with_chain(session, Chain([recorder]), prompt, 8, 4)
    history = prompt + [t for step in steps for t in step.tokens]
    assert recorder.events == [("begin", len(prompt))]
    recorder.events.clear()
    session.prepare(history + [3, 4])  # an extension: nothing was removed, nothing to forget
    assert recorder.events == []
    session.prepare(prompt[:20] + [1, 2, 3])  # an edit: diverges at 20
    assert recorder.events == [("truncate", 20)]
    session.prepare(prompt[:10])  # a regeneration from an earlier point: a prefix of the history
    assert recorder.events[-1] == ("truncate", 10)
    assert session.cached == 9 and session.length == 10  # the last prompt token stays pending


class WrongDrafter(Drafter):
    """Always drafts tokens the model does not want (the argmax's neighbour)."""

    name = "wrong"

    def __init__(self, model):
        self.model = model

    def draft(self, history, max_tokens):
        logits = self.model(torch.tensor([history.tolist()], device=self.model.device)).logits[0, -1]
        return Draft([(int(logits.argmax()) + 1) % 384] * max_tokens)


def test_rejected_draft_tokens_leave_the_cache(engine, model):
    prompt = list(range(30, 70))
    plain = engine.generate(prompt, SamplingParams(max_tokens=20), spec=NONE)
    session = engine.session("crop")
    tokens = []
    session.use_chain(Chain([WrongDrafter(model)]))
    session.prepare(prompt)
    stats = GenerationStats()
    for step in generate_steps(session, prompt, Sampler(SamplingParams()), 8, 20, 512, frozenset({EOS}), stats):
        tokens += step.tokens
        assert step.drafted == min(8, 20 - len(tokens)) and step.accepted == 0
        assert session.cached == session.length - 1  # only the pending token is outside the cache
    assert tokens == plain.tokens
    assert stats.target_forwards == len(tokens)


def test_eos_inside_an_accepted_draft_ends_generation(engine):
    prompt = list(range(100, 140))
    plain = engine.generate(prompt, SamplingParams(max_tokens=24), spec=NONE)
    assert EOS not in plain.tokens
    stop_token = plain.tokens[6]  # pretend the seventh greedy token ends the sequence
    first_eos = plain.tokens.index(stop_token)
    steps, stats = run_with_chain(engine.session("eos"), Chain([FixedContinuation(len(prompt), plain.tokens)]), prompt,
                                  24, 16, eos_ids=frozenset({stop_token}))
    emitted = [t for step in steps for t in step.tokens]
    assert emitted == plain.tokens[: first_eos + 1]
    assert steps[-1].finished == "eos"
    assert stats.drafted_tokens > len(emitted)  # the draft ran past the EOS, and none of that was emitted
    assert stats.accepted_tokens == first_eos + 1  # the drafted EOS was accepted; what followed it was not
    assert stats.target_forwards == 1
    assert engine.sessions["eos"].length == len(prompt) + len(emitted)


def test_max_tokens_is_exact_with_long_drafts(engine):
    rng = np.random.default_rng(3)
    prompt = random_prompt(rng, 100, repetitive=True)
    for max_tokens in (1, 2, 7, 33):
        result = engine.generate(prompt, SamplingParams(max_tokens=max_tokens),
                                 spec=SpecConfig(spec=("prompt-lookup",), draft_max=64, ngram_min=1))
        assert len(result.tokens) == max_tokens or result.finish_reason == "eos"
        assert result.stats.generated_tokens == len(result.tokens)


def test_stop_string_cuts_text_and_history(engine, tokenizer):
    prompt = tokenizer("def wrap(text, width):\n    lines = []\n").input_ids
    plain = engine.generate(prompt, SamplingParams(max_tokens=40), spec=NONE)
    assert len(plain.text) > 12
    stop = plain.text[8:11]
    result = engine.generate(prompt, SamplingParams(max_tokens=40, stop=(stop,)), session_id="stop", spec=LOOKUP)
    assert result.finish_reason == "stop"
    assert result.text == plain.text[: plain.text.index(stop)]
    assert result.tokens == plain.tokens[: len(result.tokens)]
    assert stop in tokenizer.decode(result.tokens) and stop not in tokenizer.decode(result.tokens[:-1])
    assert engine.sessions["stop"].length == len(prompt) + len(result.tokens)


def test_streamed_text_is_the_final_text(engine, tokenizer):
    prompt = tokenizer("class TextWrapper:\n").input_ids
    for stop in ((), ("  ",)):
        chunks = list(engine.stream(prompt, SamplingParams(max_tokens=40, stop=stop), spec=LOOKUP))
        assert "".join(c.text for c in chunks) == chunks[-1].result.text


def test_context_limits(engine):
    with pytest.raises(CodespecError, match="context"):
        engine.generate(list(range(1, 300)) * 2, SamplingParams(max_tokens=4))
    with pytest.raises(CodespecError, match="empty"):
        engine.generate([], SamplingParams(max_tokens=4))
    prompt = list(range(1, 300)) + list(range(1, 200))
    result = engine.generate(prompt, SamplingParams(max_tokens=100), spec=LOOKUP)
    assert result.finish_reason == "length"
    assert len(prompt) + len(result.tokens) == 512  # filled the context exactly, never past it
