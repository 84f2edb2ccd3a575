"""--prompt-precision: long prompt chunks through projections rounded to bfloat16 (float32 sums). Only a long
prompt's cache changes, by bfloat16's rounding; generated tokens and verified drafts keep the float32 weights."""

import copy
import subprocess
import sys

import pytest
import torch

from codespec.config import ModelConfig
from codespec.forward.kernels import layers
from codespec.forward import LeanLlama, Rows, bfloat16_pays
from tests.tiny import tiny_arch_model

PROMPT = list(range(3, 3 + 40))  # more rows than layers.FEW_ROWS: a chunk the bfloat16 weights take


def pair(kind):
    model = tiny_arch_model(kind, dtype=torch.float32)
    return LeanLlama(model, prompt_precision="bfloat16"), LeanLlama(model, prompt_precision="float32")


def forward(lean, cache, ids, **flags):
    return lean.batch([Rows(cache, ids, len(ids), **flags)])[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_long_prompt_chunk_is_rounded_to_bfloat16_and_nothing_else_is(kind):
    low, exact = pair(kind)
    assert low.prompt_weights is not None and exact.prompt_weights is None
    low_cache, exact_cache = low.new_cache(), exact.new_cache()
    rounded = forward(low, low_cache, PROMPT, prompt=True)
    reference = forward(exact, exact_cache, PROMPT, prompt=True)
    difference = (rounded - reference).abs().max().item()
    assert 0 < difference < 0.05 * reference.abs().max().item()  # bfloat16 was used, and only rounds
    assert 0 < (low_cache.keys - exact_cache.keys).abs().max().item() < 0.05 * exact_cache.keys.abs().max().item()
    # the same prompt as generated rows (not a prompt chunk) goes through the float32 weights: the same bits
    assert torch.equal(forward(low, low.new_cache(), PROMPT), forward(exact, exact.new_cache(), PROMPT))
    # a short prompt chunk too: it takes the few-row path, as every step does
    short = PROMPT[: layers.FEW_ROWS]
    assert torch.equal(forward(low, low.new_cache(), short, prompt=True),
                       forward(exact, exact.new_cache(), short, prompt=True))
    # decoding over the same cache is the same computation on both
    same = copy.deepcopy(low_cache)
    assert torch.equal(forward(low, low_cache, [7, 8], generating=True),
                       forward(exact, same, [7, 8], generating=True))


def test_a_prompt_chunk_and_decoding_rows_in_one_batch_get_what_they_get_alone():
    low, _ = pair("llama")
    decoding = low.new_cache()
    forward(low, decoding, [5, 6, 7])
    alone = [low.new_cache(), copy.deepcopy(decoding)]
    together = [low.new_cache(), copy.deepcopy(decoding)]
    expected = [forward(low, alone[0], PROMPT, prompt=True), forward(low, alone[1], [9], generating=True)]
    batched = low.batch([Rows(together[0], PROMPT, len(PROMPT), prompt=True),
                         Rows(together[1], [9], 1, generating=True)])
    for want, got in zip(expected, batched):
        assert torch.equal(want, got)
    for one, other in zip(alone, together):
        assert one.length == other.length and torch.equal(one.keys, other.keys)


def test_auto_follows_the_measurement_and_only_float32_cpus_round():
    model = tiny_arch_model("llama", dtype=torch.float32)
    assert (LeanLlama(model, prompt_precision="auto").prompt_weights is not None) == bfloat16_pays(True)
    assert LeanLlama(tiny_arch_model("llama"), prompt_precision="bfloat16").prompt_weights is None  # float64


def test_an_unknown_prompt_precision_is_a_one_line_error():
    with pytest.raises(ValueError, match="unknown prompt precision 'half'"):
        ModelConfig(prompt_precision="half").validate()
    done = subprocess.run([sys.executable, "-m", "codespec", "generate", "hi", "--prompt-precision", "half"],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "--prompt-precision" in done.stderr and len(done.stderr.splitlines()) == 1
