"""The draft-model drafter: greedy identity, its cache following the history, p_min, lossless rejection
sampling end to end, and the vocabulary check. The draft models are the target itself (a perfect draft)
and the target cut to one layer (a different distribution: drafts both accepted and rejected)."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from codespec.config import SamplingParams, SpecConfig
from codespec.decode import generate_steps
from codespec.drafters import Chain
from codespec.forward import forward_path
from codespec.drafters.draft_model import DraftModel, check_compatible, truncated_copy
from codespec.errors import CodespecError
from codespec.sampling import Sampler, warp
from codespec.session import Session
from codespec.stats import GenerationStats
from tests.conftest import random_prompt
from tests.tiny import EOS, VOCAB
from tests.helpers import run_with_chain
from tests.unit.test_sampling import chi_square

NONE = SpecConfig(spec=("none",))
DRAFT_MAX = 8


def chi2_critical_p001(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square critical value at p = 0.001 (26.3 for df 8; exact 26.12)."""
    z = 3.0902  # the standard normal quantile at 1 - 0.001
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def small(model):
    return truncated_copy(model, 1)


def emitted(steps) -> list[int]:
    return [t for step in steps for t in step.tokens]


def greedy_prompt(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return random_prompt(rng, int(rng.integers(4, 100)), repetitive=seed % 2 == 0)


@pytest.mark.parametrize("seed", range(10))
def test_greedy_identity(engine, model, small, seed):
    prompt = greedy_prompt(seed)
    plain = engine.generate(prompt, SamplingParams(max_tokens=32), spec=NONE)

    steps, _ = run_with_chain(engine.session(), Chain([DraftModel(small)]), prompt, 32, DRAFT_MAX)
    assert emitted(steps) == plain.tokens

    # the target as its own draft model, reading all of the history: every step yields a full draft plus the
    # target's own token
    steps, stats = run_with_chain(engine.session(), Chain([DraftModel(model, window=None)]), prompt, 32, DRAFT_MAX)
    assert emitted(steps) == plain.tokens
    assert stats.target_forwards == math.ceil(len(plain.tokens) / (DRAFT_MAX + 1))
    if plain.finish_reason != "eos":  # tokens drafted past an EOS are never counted as accepted
        assert stats.accepted_tokens == stats.drafted_tokens > 0


def test_the_one_layer_draft_is_both_accepted_and_rejected(engine, small):
    """The identity test above only means something if drafts were both accepted and rejected."""
    accepted = drafted = 0
    for seed in range(1, 6):
        _, stats = run_with_chain(engine.session(), Chain([DraftModel(small)]), greedy_prompt(seed), 32, DRAFT_MAX)
        accepted, drafted = accepted + stats.accepted_tokens, drafted + stats.drafted_tokens
    # about 40 of 830: one layer of two predicts the tiny random model poorly, but not never
    assert accepted >= 15 and drafted - accepted >= 15


def test_draft_cache_follows_the_history(engine, small):
    drafter = DraftModel(small)
    session = engine.session()
    prompt = random_prompt(np.random.default_rng(3), 60, repetitive=True)
    session.use_chain(Chain([drafter]))
    stats = GenerationStats()
    for _ in generate_steps(session, prompt, Sampler(SamplingParams()), DRAFT_MAX, 40, 512, frozenset({EOS}), stats):
        assert drafter.cached <= session.length
        assert drafter.tokens == session.history[: drafter.cached].tolist()
        assert drafter.cache.length == drafter.cached
    assert stats.accepted_tokens < stats.drafted_tokens  # rejections happened, so their crops were exercised

    history = session.history.tolist()
    edited = history[:30] + [7, 8, 9]  # an edit above the cursor: diverges at 30
    session.prepare(edited)
    assert drafter.cached <= 30 and drafter.cache.length == drafter.cached
    steps, _ = run_with_chain(session, Chain([drafter]), edited, 16, DRAFT_MAX)
    assert emitted(steps) == engine.generate(edited, SamplingParams(max_tokens=16), spec=NONE).tokens
    session.reset()
    assert drafter.cached == 0 and drafter.cache.length == 0


def test_a_windowed_draft_model_reads_only_recent_history_and_output_is_unchanged(engine, small):
    drafter = DraftModel(small, window=16)
    session = engine.session()
    prompt = random_prompt(np.random.default_rng(5), 60, repetitive=True)
    session.use_chain(Chain([drafter]))
    stats = GenerationStats()
    steps = []
    for step in generate_steps(session, prompt, Sampler(SamplingParams()), DRAFT_MAX, 40, 512, frozenset({EOS}),
                               stats):
        steps.append(step)
        assert drafter.cache.length == drafter.cached <= 2 * 16 + DRAFT_MAX  # two windows and a draft at most
        assert drafter.tokens == session.history[drafter.offset: drafter.offset + drafter.cached].tolist()
    assert drafter.offset > 44  # it moved on at least once while generating
    assert emitted(steps) == engine.generate(prompt, SamplingParams(max_tokens=40), spec=NONE).tokens

    fresh = DraftModel(small, window=16)
    first = fresh.draft(np.asarray(prompt), 2)  # fills 16 tokens: a catch-up, timed apart from the draft
    assert first.catch_up_seconds > 0 and fresh.offset == len(prompt) - 16
    fresh.accept(np.asarray(prompt + first.tokens[:1]), 2, 1)
    assert fresh.draft(np.asarray(prompt + first.tokens[:1] + [3]), 2).catch_up_seconds == 0  # one new token


def confidence(model, tokens: list[int]) -> float:
    """The draft model's top probability at temperature 1 for the token after `tokens`."""
    return float(model(torch.tensor([tokens])).logits[0, -1].softmax(-1).max())


def test_p_min_stops_a_draft_before_the_first_unconfident_token(engine, small):
    prompt = random_prompt(np.random.default_rng(5), 40, repetitive=True)
    history = np.array(prompt)
    full = DraftModel(small)
    full.begin(history, SamplingParams())
    greedy = full.draft(history, DRAFT_MAX).tokens
    confidences = [confidence(small, prompt + greedy[:i]) for i in range(DRAFT_MAX)]
    levels = sorted(set(confidences))
    # thresholds halfway between observed confidences, so no comparison sits on a rounding edge
    for p_min in [0.0, 1.0] + [(a + b) / 2 for a, b in zip(levels, levels[1:])]:
        drafter = DraftModel(small, p_min=p_min)
        drafter.begin(history, SamplingParams())
        draft = drafter.draft(history, DRAFT_MAX)
        kept = next((i for i, c in enumerate(confidences) if c < p_min), DRAFT_MAX)
        assert (draft.tokens if draft else []) == greedy[:kept], f"p_min={p_min}"
        assert draft is None or len(draft.tokens) > 0  # an empty draft is None

    # p_min = 1: nothing is ever confident enough; the output is still the target's
    plain = engine.generate(prompt, SamplingParams(max_tokens=24), spec=NONE)
    steps, stats = run_with_chain(engine.session(), Chain([DraftModel(small, p_min=1.0)]), prompt, 24, DRAFT_MAX)
    assert emitted(steps) == plain.tokens and stats.drafted_tokens == 0


def test_sampling_with_a_draft_model_matches_the_models_distribution(model, small):
    """The joint distribution of the first two sampled tokens equals the exact one from the target.
    max_tokens=3 makes the first step draft two tokens, so both positions go through q and the residual."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3)
    prompt = [5, 17, 42, 17, 42, 17]
    first = warp(model(torch.tensor([prompt])).logits[0, -1:], params)[0]
    exact, outcomes = [], []
    for t1 in torch.nonzero(first).flatten().tolist():
        second = warp(model(torch.tensor([prompt + [t1]])).logits[0, -1:], params)[0]
        for t2 in torch.nonzero(second).flatten().tolist():
            outcomes.append((t1, t2))
            exact.append(float(first[t1] * second[t2]))
    q_first = warp(small(torch.tensor([prompt])).logits[0, -1:], params)[0]
    assert not torch.allclose(q_first, first, atol=0.05)  # the draft really is a different distribution

    drafter = DraftModel(small)
    session = Session(forward_path(model), Chain([drafter]))

    def sample(seed: int) -> tuple[list[int], GenerationStats]:
        # a seed per trial, as the engine gives every generation its own sampler
        stats = GenerationStats()
        steps = generate_steps(session, prompt, Sampler(replace(params, seed=seed)), 2, 3, 512, frozenset({EOS}), stats)
        return emitted(steps), stats

    counts = np.zeros(len(outcomes))
    drafted = accepted = 0
    for seed in range(1500):
        tokens, stats = sample(seed)
        counts[outcomes.index(tuple(tokens[:2]))] += 1
        drafted, accepted = drafted + stats.drafted_tokens, accepted + stats.accepted_tokens
        assert drafter.cached <= session.length
    assert chi_square(counts, np.array(exact)) < chi2_critical_p001(len(outcomes) - 1)
    assert 0 < accepted / drafted < 1  # accepted often, rejected often: the residual path was sampled
    assert sample(7)[0] == sample(7)[0]  # a seed reproduces the output, draft included


def bpe_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([torch.nn.Module.__doc__ * 20], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def test_check_compatible(tokenizer):
    check_compatible(tokenizer, tokenizer)
    check_compatible(bpe_tokenizer(VOCAB), bpe_tokenizer(VOCAB))
    with pytest.raises(CodespecError, match="vocabulary differs") as raised:
        check_compatible(tokenizer, bpe_tokenizer(VOCAB - 40))
    assert "\n" not in str(raised.value)
    with pytest.raises(CodespecError, match="vocabulary differs"):  # same size, other merges
        check_compatible(tokenizer, bpe_tokenizer(VOCAB))


def test_truncated_copy_shares_weights_and_slices_per_layer_config():
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    full = Qwen2ForCausalLM(config).eval()
    draft = truncated_copy(full, 2)
    assert len(draft.model.layers) == 2 and draft.config.num_hidden_layers == 2
    assert draft.config.layer_types == ["full_attention"] * 2
    assert len(full.model.layers) == 3 and full.config.num_hidden_layers == 3 and len(full.config.layer_types) == 3
    assert draft.lm_head.weight.data_ptr() == full.lm_head.weight.data_ptr()  # no second copy of the weights
    draft.to(torch.float64)
    assert full.lm_head.weight.dtype == torch.float32  # converting the copy leaves the original alone
    drafter = DraftModel(draft)
    drafter.begin(np.arange(1, 9), SamplingParams())
    assert len(drafter.draft(np.arange(1, 9), 4).tokens) == 4
    with pytest.raises(CodespecError, match="layers"):
        truncated_copy(full, 4)
