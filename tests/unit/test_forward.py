"""The lean forward computes what transformers computes, with a cache that rolls back by position."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from codespec.forward import LeanLlama, Linear, Rows, TransformersForward, forward_path
from tests.tiny import tiny_arch_model, tiny_model


# transformers' RMSNorm computes in float32 even for a float64 model, so the two paths differ by ~1e-6
FLOAT64 = 1e-5


def assert_close(lean_logits, reference_logits, tolerance):
    assert lean_logits.shape == reference_logits.shape
    assert (lean_logits - reference_logits).abs().max().item() < tolerance


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_lean_matches_transformers_through_prefill_decode_verify_and_rollback(kind):
    model = tiny_arch_model(kind)
    assert LeanLlama.supports(model) is None
    assert kind != "qwen2" or model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # Qwen2: biases matter
    lean, reference = LeanLlama(model), TransformersForward(model)
    lean_cache, reference_cache = lean.new_cache(), reference.new_cache()
    prompt = list(range(3, 40))
    assert_close(lean(lean_cache, prompt, len(prompt)), reference(reference_cache, prompt, len(prompt)), FLOAT64)
    for token in (7, 8, 9):  # one-token decoding
        assert_close(lean(lean_cache, [token], 1), reference(reference_cache, [token], 1), FLOAT64)
    draft = [11, 12, 13, 14, 15]  # a verify forward: every position's logits, then a rollback of three
    assert_close(lean(lean_cache, draft, 5), reference(reference_cache, draft, 5), FLOAT64)
    lean_cache.crop(len(prompt) + 5)
    reference_cache.crop(len(prompt) + 5)
    assert lean_cache.length == reference_cache.length == len(prompt) + 5
    # what was written past the rollback point is overwritten, never read
    assert_close(lean(lean_cache, [21, 22], 2), reference(reference_cache, [21, 22], 2), FLOAT64)


def test_cache_grows_past_its_initial_capacity(model, monkeypatch):
    monkeypatch.setattr(LeanLlama, "INITIAL_CAPACITY", 8)
    lean, reference = LeanLlama(model), TransformersForward(model)
    lean_cache, reference_cache = lean.new_cache(), reference.new_cache()
    assert lean_cache.capacity == 8
    for chunk in ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], list(range(12, 40))):
        assert_close(lean(lean_cache, chunk, 1), reference(reference_cache, chunk, 1), FLOAT64)
    assert lean_cache.capacity >= 39 and lean_cache.length == 39


def test_crop_never_lengthens():
    cache = LeanLlama(tiny_model()).new_cache()
    cache.length = 5
    cache.crop(9)
    assert cache.length == 5
    cache.crop(2)
    assert cache.length == 2


def test_float32_packed_weights_match_plain_linear():
    weight = torch.randn(300, 64, dtype=torch.float32)
    x = torch.randn(5, 64, dtype=torch.float32)
    linear = Linear(weight)
    assert linear.packed is not None  # the CPU build has oneDNN; this is the path the default model takes
    assert torch.allclose(linear(x), x @ weight.T, atol=1e-4)
    assert torch.allclose(linear(x[:1]), x[:1] @ weight.T, atol=1e-4)


def test_float32_lean_model_matches_transformers():
    model = tiny_model(dtype=torch.float32)
    lean, reference = LeanLlama(model), TransformersForward(model)
    prompt = list(range(5, 30))
    assert_close(lean(lean.new_cache(), prompt, 4), reference(reference.new_cache(), prompt, 4), 1e-3)


@pytest.mark.parametrize("change, reason", [
    (dict(attention_bias=True), "projection biases"),  # Llama's biases include o_proj's
    (dict(layer_types=["sliding_attention"], sliding_window=8), "sliding-window layers"),
    (dict(hidden_act="gelu"), "activation"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "rope type"),
])
def test_models_the_lean_path_cannot_run_fall_back_to_transformers(change, reason):
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, **change)
    model = LlamaForCausalLM(config).eval()
    assert reason in LeanLlama.supports(model)
    assert isinstance(forward_path(model), TransformersForward)
    assert isinstance(forward_path(tiny_model()), LeanLlama)
    assert isinstance(forward_path(tiny_model(), lean=False), TransformersForward)


ROPE_SCALING = {  # Llama 3.x's (llama3), and the other kinds fixed at load: their frequencies, yarn's factor too
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("rope", list(ROPE_SCALING))
def test_rope_scaling_fixed_at_load_runs_on_the_lean_path_as_transformers_computes_it(rope):
    """Llama 3.x's rope scaling (and linear and yarn): the lean forward takes transformers' rotary frequencies and
    factor, and matches its forward past the original context (positions beyond 16 here)."""
    from tests.tiny import VOCAB, tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config(VOCAB, 512), rope_parameters=ROPE_SCALING[rope]))
    model = model.double().eval()
    assert LeanLlama.supports(model) is None
    lean, reference = LeanLlama(model), TransformersForward(model)
    prompt = list(range(3, 60))
    assert_close(lean(lean.new_cache(), prompt, len(prompt)), reference(reference.new_cache(), prompt, len(prompt)),
                 FLOAT64)
    plain = LlamaForCausalLM(LlamaConfig(**tiny_config(VOCAB, 512))).double().eval()
    plain.load_state_dict(model.state_dict())
    assert (lean(lean.new_cache(), prompt, 1) - LeanLlama(plain)(LeanLlama(plain).new_cache(), prompt, 1)).abs().max() > 1e-3


def test_layers_run_under_torchscript_and_match_the_interpreted_function(model, monkeypatch):
    from codespec import forward

    lean = LeanLlama(model)
    assert isinstance(lean.run_layers, torch.jit.ScriptFunction)  # this torch build can script it
    prompt = list(range(3, 30))
    scripted = lean(lean.new_cache(), prompt, 3)
    monkeypatch.setattr(lean, "run_layers", forward.run_layers)
    assert torch.equal(lean(lean.new_cache(), prompt, 3), scripted)


@pytest.mark.parametrize("lean", [True, False])
def test_a_batch_of_sequences_gives_each_the_logits_it_gets_alone(model, lean):
    """Three sessions at different lengths (a prefill chunk, a one-token decode, a verify) in one forward."""
    path = LeanLlama(model) if lean else TransformersForward(model)
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(50, 60))]
    fed = [[41, 42, 43, 44], [8], [61, 62, 63, 64, 65]]
    alone, together = [path.new_cache() for _ in prompts], [path.new_cache() for _ in prompts]
    for prompt, one, other in zip(prompts, alone, together):
        path(one, prompt, 1)
        path(other, prompt, 1)
    expected = [path(cache, ids, len(ids)) for cache, ids in zip(alone, fed)]
    batched = path.batch([Rows(cache, ids, len(ids)) for cache, ids in zip(together, fed)])
    for want, got, one, other in zip(expected, batched, alone, together):
        assert_close(got, want, 1e-10)  # float64: the same numbers up to summation order
        assert one.length == other.length
    # and the caches hold the same keys: the next forward agrees too
    for one, other in zip(alone, together):
        assert_close(path(other, [9], 1), path(one, [9], 1), 1e-10)
