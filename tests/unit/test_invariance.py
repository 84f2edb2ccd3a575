"""--invariant on (the default): a token's keys, values and logits do not depend on the rows it was computed with:
its prompt in one chunk or many, beside other sessions' rows, or after a prefix a session had cached. So greedy
text does not depend on the server's load or on what a session served before (issue: 1 of 12 prompts changed after
another request, 23 of 24 under 8 clients)."""

import numpy as np
import pytest
import torch

from codespec.config import SamplingParams, SpecConfig
from codespec.engine import Engine
from codespec.forward import Rows, forward_path
from tests.tiny import EOS, tiny_arch_model
from tests.gguf_files import write_gguf

PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 300, 90)]
SPLITS = {"one chunk": [89], "32": [32, 32, 25], "16": [16] * 5 + [9], "7": [7] * 12 + [5], "one by one": [1] * 89,
          "40 + rest": [40, 49]}
ACTIVATIONS = ["float32", pytest.param("q8", marks=pytest.mark.needs_kernels("q8 block tiles"))]


def lean(tmp_path, activations: str, invariant: bool = True):
    model = tiny_arch_model("llama", dtype=torch.float32)
    path = forward_path(model, gguf=write_gguf(tmp_path / "tiny.gguf", model, permute=True), activations=activations,
                        invariant=invariant)
    assert path.invariant == invariant
    return path


def prefill(path, sizes: list[int], neighbour=None):
    """The prompt in chunks of `sizes` (every chunk beside a chunk of `neighbour`'s own prompt when given, in one
    forward), then its last token: the cache's keys and values for the prompt, and the last token's logits."""
    cache, other, start = path.new_cache(), path.new_cache(), 0
    for size in sizes:
        rows = [Rows(cache, PROMPT[start : start + size], 1, prompt=True)]
        if neighbour is not None:
            rows.append(Rows(other, neighbour[start : start + size + 3], 1, prompt=True))
        path.batch(rows)
        start += size
    logits = path.batch([Rows(cache, PROMPT[-1:], 1, generating=True)])[0]
    return cache.keys[:, :, : len(PROMPT)].clone(), cache.values[:, :, : len(PROMPT)].clone(), logits


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_a_prompt_gets_the_same_bits_in_any_chunks_and_beside_other_sessions(tmp_path, activations):
    path = lean(tmp_path, activations)
    keys, values, logits = prefill(path, SPLITS["one chunk"])
    other = [int(t) for t in np.random.default_rng(1).integers(3, 300, 200)]
    for name, sizes in SPLITS.items():
        for neighbour in (None, other):
            got = prefill(path, sizes, neighbour)
            assert torch.equal(got[0], keys) and torch.equal(got[1], values), (name, neighbour is not None)
            assert torch.equal(got[2], logits), (name, neighbour is not None)


def test_without_it_long_chunks_take_a_gemm_whose_bits_depend_on_the_chunk(tmp_path):
    """--invariant off: what the default guards against (chunks over 16 rows in PyTorch's GEMM, shorter ones in
    numba: other sums, other bits)."""
    path = lean(tmp_path, "float32", invariant=False)
    keys, _, logits = prefill(path, SPLITS["one chunk"])
    split = prefill(path, SPLITS["7"])
    assert not torch.equal(split[0], keys) and not torch.equal(split[2], logits)


def test_after_a_cached_prefix_the_text_and_the_cache_are_those_of_a_fresh_session(tmp_path, tokenizer):
    """A session that served one prompt and then gets a longer one (its prompt, the answer, a follow-up) reuses
    what it cached, part of it computed as generated tokens one step at a time: the text and the cache's bits are
    those a fresh session computes from the whole prompt in one chunk."""
    model = tiny_arch_model("llama", dtype=torch.float32)
    engine = Engine(model, tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}),
                    gguf=write_gguf(tmp_path / "tiny.gguf", model, permute=True), activations="float32")
    assert engine.path.invariant  # the engine's default
    params = SamplingParams(max_tokens=24)
    first = engine.generate(PROMPT[:50], params, session_id="warm")
    follow_up = PROMPT[:50] + first.tokens + PROMPT[50:]
    again = engine.generate(follow_up, params, session_id="warm")
    fresh = engine.generate(follow_up, params, session_id="fresh", spec=SpecConfig(spec=("none",)))
    assert again.stats.cached_tokens >= 50 + len(first.tokens) - 1
    assert again.tokens == fresh.tokens
    warm, cold = engine.sessions["warm"].cache, engine.sessions["fresh"].cache
    length = len(follow_up)
    assert torch.equal(warm.keys[:, :, :length], cold.keys[:, :, :length])
    assert torch.equal(warm.values[:, :, :length], cold.values[:, :, :length])


def test_the_flag_reaches_the_engine_and_conflicts_are_refused(tmp_path):
    from codespec.cli.options import build_parser, settings_from_args
    from codespec.errors import CodespecError

    model_config, _, _ = settings_from_args(build_parser().parse_args(["generate", "--invariant", "off", "x"]))
    assert model_config.invariant == "off"
    with pytest.raises(ValueError, match="unknown invariant 'maybe'"):
        type(model_config)(invariant="maybe").validate()
    model = tiny_arch_model("llama", dtype=torch.float32)
    with pytest.raises(CodespecError, match="--invariant off"):
        forward_path(model, gguf=write_gguf(tmp_path / "tiny.gguf", model, permute=True), activations="float32",
                     prompt_precision="bfloat16", invariant=True)
