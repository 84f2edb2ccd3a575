"""Speculative sampling has exactly the target's distribution. Seeds are fixed, so these tests are
deterministic; the thresholds are chi-square critical values at p = 0.001."""

import numpy as np
import pytest
import torch

from codespec import sampling
from codespec.config import SamplingParams
from codespec.decode import generate_steps
from codespec.drafters import Chain
from codespec.forward import forward_path
from codespec.drafters.none import NoDrafter
from codespec.sampling import Sampler, WarpedRows, draw, verify_rejection, verify_sampled_exact, warp
from codespec.stats import GenerationStats
from tests.tiny import EOS, FixedContinuation

CHI2_CRITICAL = {4: 18.47, 8: 26.12}  # df -> critical value at p = 0.001


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token with probability 0 was sampled"
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


def test_warp_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0)), torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    top2 = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    top_p = warp(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.2 < 0.8, so 0.15 is kept too
    assert torch.allclose(top_p, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    cold = warp(logits, SamplingParams(temperature=0.25))
    assert cold[0, 0] > 0.95


P = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
Q = torch.tensor([0.1, 0.1, 0.5, 0.2, 0.1])


def first_token_counts(trials: int, verify) -> np.ndarray:
    generator = torch.Generator().manual_seed(1234)
    counts = np.zeros(len(P))
    for _ in range(trials):
        counts[verify(generator)] += 1
    return counts


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=40, top_p=0.99),
                                    SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.3, top_k=5, top_p=0.5)])
def test_a_row_drawn_from_the_kept_tokens_is_the_token_drawn_from_the_whole_vocabulary(params):
    """WarpedRows.draw takes the tokens top-k and top-p keep, in token order, and inverts their cumulative sum at
    the same one uniform draw as draw() over the whole warped row: the same token for every seed (on a CPU in numba:
    sampling._draw_top and _draw_weighted; flat rows, where top-p keeps hundreds of tokens, included)."""
    tokens = set()
    for flat in range(4):
        logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(flat)) * 3
        rows = WarpedRows(logits, params)
        warped = [rows[row] for row in range(4)]
        for seed in range(100):
            whole, kept = (torch.Generator().manual_seed(seed) for _ in range(2))
            token = rows.draw(seed % 4, kept)
            assert token == draw(warped[seed % 4], whole)
            assert torch.equal(whole.get_state(), kept.get_state())  # one draw each
            tokens.add(token)
    assert len(tokens) > 3


@pytest.mark.parametrize("top_k", [0, 1, 3, 8, 9])
def test_a_drawn_row_never_takes_a_token_warp_drops_and_of_equal_logits_ranks_the_lower_id_first(top_k):
    """Rows with -inf logits (a constraint's), ties, a top-p that keeps one token and a top-k of the whole
    vocabulary: every token drawn has a probability under warp(); top-k 1 and the smallest top-p take the largest
    logit, of equal ones the lowest id."""
    logits = torch.tensor([[2.0, 5.0, float("-inf"), 5.0, 1.0, float("-inf"), 5.0, 0.5, -3.0],
                           [float("-inf")] * 4 + [0.0] + [float("-inf")] * 4])
    for params in (SamplingParams(temperature=1.0, top_k=top_k), SamplingParams(temperature=0.5, top_k=top_k, top_p=0.7),
                   SamplingParams(temperature=2.0, top_k=top_k, top_p=1e-6)):
        rows, probs = WarpedRows(logits, params), warp(logits, params)
        for seed in range(60):
            for row in range(2):
                token = rows.draw(row, torch.Generator().manual_seed(seed))
                assert probs[row, token] > 0
                if top_k == 1 or params.top_p == 1e-6:
                    assert token == (1 if row == 0 else 4)


def test_exact_match_with_a_deterministic_draft_samples_the_target():
    probs = torch.stack([P, P])  # [k+1, vocab], k = 1

    def verify(generator):
        accepted, token = verify_sampled_exact(probs, [2], generator)
        return 2 if accepted else token

    assert chi_square(first_token_counts(6000, verify), P.numpy()) < CHI2_CRITICAL[4]


def test_rejection_sampling_with_draft_probabilities_samples_the_target():
    probs = torch.stack([P, P])

    def verify(generator):
        draft = int(torch.multinomial(Q, 1, generator=generator))
        accepted, token = verify_rejection(probs, [draft], Q[None], generator)
        return draft if accepted else token

    assert chi_square(first_token_counts(6000, verify), P.numpy()) < CHI2_CRITICAL[4]


def test_rejection_sampling_accepts_everything_when_draft_equals_target():
    """Exact match would accept only sum(p^2) = 29% here; rejection sampling accepts all."""
    generator = torch.Generator().manual_seed(5)
    probs = torch.stack([P, P])
    accepted = 0
    for _ in range(500):
        draft = int(torch.multinomial(P, 1, generator=generator))
        accepted += verify_rejection(probs, [draft], P[None], generator)[0]
    assert accepted == 500


@pytest.mark.parametrize("drafter", ["none", "fixed"])
def test_speculative_sampling_matches_the_models_distribution(model, drafter):
    """The joint distribution of the first two sampled tokens equals the exact one from the model."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=2, seed=99)
    prompt = [5, 17, 42, 17, 42, 17]
    first = warp(model(torch.tensor([prompt], device=model.device)).logits[0, -1:], params)[0]
    support1 = torch.nonzero(first).flatten().tolist()
    exact, outcomes = [], []
    for t1 in support1:
        second = warp(model(torch.tensor([prompt + [t1]], device=model.device)).logits[0, -1:], params)[0]
        for t2 in torch.nonzero(second).flatten().tolist():
            outcomes.append((t1, t2))
            exact.append(float(first[t1] * second[t2]))
    greedy1 = int(first.argmax())
    greedy2 = int(warp(model(torch.tensor([prompt + [greedy1]], device=model.device)).logits[0, -1:], params)[0].argmax())

    from codespec.session import Session

    session = Session(forward_path(model), Chain([NoDrafter() if drafter == "none" else FixedContinuation(len(prompt), [greedy1, greedy2])]))
    sampler = Sampler(params)
    counts = np.zeros(len(outcomes))
    drafted = accepted = 0
    for _ in range(1500):
        stats = GenerationStats()
        tokens = [t for step in generate_steps(session, prompt, sampler, 2, 2, 512, frozenset({EOS}), stats)
                  for t in step.tokens]
        counts[outcomes.index(tuple(tokens))] += 1
        drafted, accepted = drafted + stats.drafted_tokens, accepted + stats.accepted_tokens
    assert chi_square(counts, np.array(exact)) < CHI2_CRITICAL[8]
    if drafter == "fixed":  # the drafts were really used: often accepted, often rejected
        assert 0.2 < accepted / drafted < 0.9


@pytest.mark.parametrize("vocab", [49152, 152064, 1000, 300, 100])
def test_top_k_of_float32_rows_is_torch_topks_and_takes_the_lower_id_of_equal_logits(vocab):
    """sampling.top (numba's `_top` on a CPU's float32 rows, skipping the blocks that hold none of the k largest)
    gives torch.topk's values and ids, largest first, for one row and several, k from 1 to 100; among equal logits
    the lower ids, in order; -inf logits only where fewer than k are finite."""
    generator = torch.Generator().manual_seed(vocab)
    for rows, k in ((1, 40), (3, 40), (2, 1), (1, 100), (4, 7)):
        logits = torch.randn(rows, vocab, generator=generator) * 4
        logits[0, vocab // 3] = 50.0  # a clear winner, and its block the only one read first
        values, ids = sampling.top(logits, k)
        expected = torch.topk(logits, k, dim=-1)
        assert torch.equal(values, expected.values) and torch.equal(ids, expected.indices)
    tied = torch.zeros(1, vocab)
    tied[0, 7 : 7 + 50] = 1.0  # 50 equal logits for 9 places
    tied[0, vocab // 2 :] = float("-inf")
    tied[0, -1] = 2.0
    values, ids = sampling.top(tied, 10)
    assert ids[0].tolist() == [vocab - 1] + list(range(7, 16)) and values[0].tolist() == [2.0] + [1.0] * 9
    with pytest.raises(RuntimeError):  # torch.topk's own error for more than the row holds
        sampling.top(torch.zeros(1, vocab), vocab + 1)
    assert torch.equal(sampling.top(torch.arange(vocab, dtype=torch.float32)[None], vocab)[1][0],
                       torch.arange(vocab - 1, -1, -1))
    lonely = torch.full((1, vocab), float("-inf"))
    lonely[0, 3] = 0.0
    values, ids = sampling.top(lonely, 5)
    assert ids[0, 0].item() == 3 and values[0, 1:].isinf().all()
