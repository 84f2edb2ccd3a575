"""Lossless on every architecture the transformers path loads, not only the default Llama: Qwen2 (attention
biases), Gemma 3 (sliding-window layers shorter than the prompts), LFM2 (a cache that cannot roll back), in
float64 and float32 (identity asserted) and in bfloat16 and float16 (they must run; the bench reports identity)."""

import json
import sys

import numpy as np
import pytest
import torch

from codespec.config import SPEC_CHOICES, SamplingParams, SpecConfig
from codespec.engine import Engine
from codespec.errors import CodespecError
from codespec.forward import LeanLlama, TransformersForward, forward_path
from tests.conftest import random_prompt
from tests.tiny import EOS, SLIDING_WINDOW, tiny_arch_model, tiny_tokenizer

PLAIN = SpecConfig(spec=("none",))
SMALL = dict(mod_n=3, mod_pool_size=1 << 16, draft_layers=1, ngram_min=1, adaptive=False)
DRAFTERS = [name for name in SPEC_CHOICES if name != "none"]
PARAMS = SamplingParams(max_tokens=32)


def engine_for(kind, dtype, forward="lean"):
    pool = {name: value for name, value in SMALL.items() if name.startswith("mod_")}  # the engine's one pool
    return Engine(tiny_arch_model(kind, dtype), tiny_tokenizer(), SpecConfig(**pool), eos_token_ids=frozenset({EOS}),
                  forward=forward)


def plain(engine, prompt):
    return engine.generate(prompt, PARAMS, spec=PLAIN).tokens


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])
def test_every_drafter_is_lossless_through_edits_and_regenerations(kind, dtype):
    """One session per drafter: a generation, an edit above the cursor and a regeneration from an earlier
    point, each token-identical to plain greedy in a fresh session. The prompts are longer than Gemma 3's
    window, so its sliding layers are cropped below the window on every rejected draft."""
    engine = engine_for(kind, dtype)
    accepted = {}
    for seed in range(3):
        rng = np.random.default_rng(300 + seed)
        prompt = random_prompt(rng, int(rng.integers(3 * SLIDING_WINDOW, 120)), repetitive=True)
        edited = prompt[:10] + [7, 8, 9] + prompt[10:]  # an edit above the cursor
        regeneration = prompt[: len(prompt) - 5]
        expected = [plain(engine, turn) for turn in (prompt, edited, regeneration)]
        for name in DRAFTERS:
            reference = expected[0] if name == "edit-align" else None  # edit-align drafts from a reference
            for turn, tokens in zip((prompt, edited, regeneration), expected):
                result = engine.generate(turn, PARAMS, spec=SpecConfig(spec=(name,), **SMALL),
                                         session_id=f"{name}-{seed}", reference=reference)
                assert result.tokens == tokens, f"{kind} {name} seed {seed}"
                accepted[name] = accepted.get(name, 0) + result.stats.accepted_tokens
    assert all(accepted[name] > 0 for name in ("prompt-lookup", "ngram-mod", "edit-align")), accepted


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind,forward", [("llama", "lean"), ("llama", "transformers"), ("qwen2", "lean"),
                                          ("gemma3", "lean")])
def test_half_precision_runs_with_speculation(kind, forward, dtype):
    """float16 once crashed in the lean path's rotary multiply. In half precision speculative and plain output
    may differ in rounding, so this asserts that it runs; `codespec bench` reports how often they agree."""
    engine = engine_for(kind, dtype, forward)
    assert isinstance(engine.path, LeanLlama) == (kind in ("llama", "qwen2", "qwen3") and forward == "lean")
    prompt = random_prompt(np.random.default_rng(5), 3 * SLIDING_WINDOW, repetitive=True)
    drafted = 0
    for name in ("prompt-lookup", "ngram-mod"):
        result = engine.generate(prompt, PARAMS, spec=SpecConfig(spec=(name,), **SMALL), session_id=name)
        assert len(result.tokens) == PARAMS.max_tokens or result.finish_reason == "eos"
        drafted += result.stats.drafted_tokens
    assert drafted > 0


def test_sliding_window_cache_crops_below_the_window_and_matches_a_fresh_cache():
    model = tiny_arch_model("gemma3")
    path = forward_path(model)
    assert isinstance(path, TransformersForward) and path.rewindable
    tokens = random_prompt(np.random.default_rng(1), 3 * SLIDING_WINDOW, repetitive=False)
    cache = path.new_cache()
    path(cache, tokens, 1)
    cache.crop(5)  # far below the window, which transformers' own sliding cache refuses
    assert cache.length == 5
    rolled_back = path(cache, tokens[5:], len(tokens) - 5)
    fresh = path(path.new_cache(), tokens, len(tokens) - 5)
    torch.testing.assert_close(rolled_back, fresh, rtol=0, atol=1e-12)
    # and the sliding layers really slide: the model's own generate (its sliding cache) agrees
    prompt = tokens[:40]
    ours = Engine(model, tiny_tokenizer(), PLAIN, eos_token_ids=frozenset({EOS})).generate(prompt, PARAMS).tokens
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=PARAMS.max_tokens, do_sample=False,
                            eos_token_id=EOS, pad_token_id=EOS)[0, len(prompt):].tolist()
    assert ours == theirs


def test_a_cache_that_cannot_roll_back_decodes_plainly_and_recomputes_after_an_edit():
    """LFM2's convolution state cannot be taken back: the engine does not speculate on it, and a prompt that
    diverges from the session's history is computed again from the start."""
    model = tiny_arch_model("lfm2")
    engine = Engine(model, tiny_tokenizer(), SpecConfig(), eos_token_ids=frozenset({EOS}))
    assert not engine.path.rewindable
    prompt = random_prompt(np.random.default_rng(2), 60, repetitive=True)
    first = engine.generate(prompt, PARAMS, session_id="s", spec=SpecConfig(spec=("prompt-lookup",), **SMALL))
    assert first.stats.drafted_tokens == 0
    assert first.tokens == model.generate(torch.tensor([prompt]), max_new_tokens=PARAMS.max_tokens, do_sample=False,
                                          eos_token_id=EOS, pad_token_id=EOS)[0, len(prompt):].tolist()
    extended = engine.generate(prompt + first.tokens + [5, 6], PARAMS, session_id="s")
    assert extended.stats.cached_tokens == len(prompt) + len(first.tokens) - 1  # an extension keeps the cache
    edited = prompt[:20] + [5, 6] + prompt[20:]
    again = engine.generate(edited, PARAMS, session_id="s")
    assert again.stats.cached_tokens == 0 and again.tokens == plain(engine, edited)


def test_an_architecture_no_path_supports_is_a_one_line_error(tmp_path):
    import subprocess

    folder = tmp_path / "frob"
    folder.mkdir()
    tiny_tokenizer().save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "frobnicator", "architectures": ["FrobForCausalLM"]}))
    done = subprocess.run([sys.executable, "-m", "codespec", "generate", "--model", str(folder), "hi"],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"codespec: error: unsupported architecture: model type 'frobnicator' (FrobForCausalLM) is unknown to "
        f"transformers {__import__('transformers').__version__}"]


def test_a_model_whose_forward_cannot_take_a_cache_is_refused_at_load():
    class NoCache(torch.nn.Module):
        config = tiny_arch_model("llama").config
        device = torch.device("cpu")

        def forward(self, **inputs):
            raise TypeError("forward() got an unexpected keyword argument 'past_key_values'")

    message = r"^unsupported architecture: 'llama' \(NoCache\) does not run with a key-value cache: forward\(\)"
    with pytest.raises(CodespecError, match=message):
        Engine(NoCache(), tiny_tokenizer(), SpecConfig(), eos_token_ids=frozenset({EOS}), forward="transformers")
