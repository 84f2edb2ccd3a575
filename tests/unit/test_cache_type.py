"""--cache-type f16: keys and values kept as float16, as llama.cpp keeps them by default (attention.py reads them)."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from codespec.forward.kernels import attention
from codespec.cli.options import build_parser, settings_from_args
from codespec.adaptive import Adaptive
from codespec.config import ModelConfig, SamplingParams, SpecConfig
from codespec.engine import Engine
from codespec.errors import CodespecError
from codespec.forward import Rows, StaticCache, forward_path
from tests.tiny import EOS, tiny_arch_model
from tests.gguf_files import write_gguf


def attend_once(cache: StaticCache, heads: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`count` new rows (random queries, keys and values) attend to `cache` (one layer) in the kernel: their qk,
    values and attention [count, heads, dim]."""
    kv_heads, dim = cache.shape[1], cache.shape[3] - (4 if cache.keys.dtype == torch.int8 else 0)
    qk = torch.randn(count, heads + kv_heads, dim) / dim ** 0.5
    new_values = torch.randn(count, kv_heads, dim)
    out = torch.empty(count, heads, dim)
    table = attention.make_table([Rows(cache, [0] * count, count)], [0], heads)
    torch.ops.codespec.cached_attention(qk, new_values, out, table, 0, heads, kv_heads, heads * count,
                                        attention.padded_width(cache.length + count))
    return qk, new_values, out


def causal(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """PyTorch's attention of queries [count, heads, dim] at positions start.. to keys and values [kv_heads, end,
    dim]: [count, heads, dim]."""
    count, end = queries.shape[0], keys.shape[1]
    mask = torch.zeros(count, end)
    mask[:, start:] = torch.full((count, count), float("-inf")).triu(1)
    return F.scaled_dot_product_attention(queries.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                          scale=1.0, enable_gqa=True)[0].transpose(0, 1)


def test_the_kernel_rounds_new_keys_to_float16_and_attends_to_the_widened_cache():
    torch.manual_seed(2)
    heads, kv_heads, dim = 9, 3, 64
    for start, count in ((0, 1), (21, 3), (700, 2)):
        cache = StaticCache(1, kv_heads, dim, 1024, torch.float16, "cpu")
        cache.keys.normal_()
        cache.values.normal_()
        cache.length = start
        qk, new_values, out = attend_once(cache, heads, count)
        end = start + count
        assert torch.equal(cache.keys[0, :, start:end], qk[:, heads:].transpose(0, 1).half())  # rounded as .half()
        assert torch.equal(cache.values[0, :, start:end], new_values.transpose(0, 1).half())
        expected = causal(qk[:, :heads], cache.keys[0, :, :end].float(), cache.values[0, :, :end].float(), start)
        assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_with_a_float16_cache_a_verify_forward_equals_one_token_forwards_bit_for_bit(tmp_path, kind):
    model = tiny_arch_model(kind, dtype=torch.float32)
    lean = forward_path(model, gguf=write_gguf(tmp_path / "tiny.gguf", model, permute=kind == "llama"),
                        cache_type="f16")
    prompt, draft = list(range(5, 45)), [11, 12, 13, 14]
    verify, decode, other = lean.new_cache(), lean.new_cache(), lean.new_cache()
    assert verify.keys.dtype == verify.values.dtype == torch.float16  # half the bytes of float32
    for cache in (verify, decode):
        lean(cache, prompt, 1)  # a prompt of 40 tokens: PyTorch's attention over the widened cache
    lean(other, list(range(20, 57)), 1)
    together = lean(verify, draft, len(draft))
    alone = torch.cat([lean(decode, [token], 1) for token in draft])
    assert torch.equal(together, alone)
    verify.crop(len(prompt))
    assert torch.equal(lean.batch([Rows(other, [3, 4, 5], 3), Rows(verify, draft[:3], 3)])[1], alone[:3])


def greedy_agrees(model, tokenizer, gguf, cache_types: tuple[str, ...], activations: str,
                  draft_max: int = 16) -> dict[str, torch.Tensor]:
    """For each cache type, speculative greedy output equals plain greedy output (asserted, with drafts accepted);
    returns each cache type's logits for the prompt, to compare their rounding."""
    prompt = list(range(10, 40)) * 3
    params = SamplingParams(max_tokens=40)
    logits = {}
    for cache_type in cache_types:
        engine = Engine(model, tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}), gguf=gguf,
                        cache_type=cache_type, activations=activations)
        plain = engine.generate(prompt, params, spec=SpecConfig(spec=("none",)))
        # the drafter asked every step: whether its calls pay follows the machine's timing (a tiny model's forward
        # costs next to nothing), and holding it back left no right draft in some runs
        with mock.patch.object(Adaptive, "pays_to_call", lambda self, drafter: True):
            spec = engine.generate(prompt, params, spec=SpecConfig(spec=("prompt-lookup",), draft_max=draft_max))
        assert spec.tokens == plain.tokens and spec.stats.accepted_tokens > 0
        logits[cache_type] = engine.path(engine.path.new_cache(), prompt, 1)
    return logits


def test_speculative_and_plain_greedy_agree_and_differ_from_a_float32_cache_only_by_rounding(tmp_path, tokenizer):
    model = tiny_arch_model("llama", dtype=torch.float32)
    path = write_gguf(tmp_path / "tiny.gguf", model, permute=True)
    # the cache's rounding alone (q8 activations': test_q8)
    logits = greedy_agrees(model, tokenizer, path, ("f16", "f32"), activations="float32")
    difference = (logits["f16"] - logits["f32"]).abs().max().item()
    assert 0 < difference < 1e-2 * logits["f32"].abs().max().item()


@pytest.mark.parametrize("source, target, count", [(300, 7, 500), (100, 400, 300)])  # down, and up (a copy first)
def test_the_cpu_kernel_moves_float16_keys_as_pytorch_does(source, target, count):
    """A cache-reuse move (llama-server's --cache-reuse) on a float16 cache: numba's, bit for bit as PyTorch's
    rotation in float64 rounded to float16."""
    path = forward_path(tiny_arch_model("llama", dtype=torch.float32), cache_type="f16")
    moved, reference = path.new_cache(), path.new_cache()
    moved.keys.normal_(), moved.values.normal_()
    reference.keys.copy_(moved.keys), reference.values.copy_(moved.values)
    path.move(moved, source, target, count)
    path.few_rows_kernel = False
    path.move(reference, source, target, count)
    assert torch.equal(moved.keys, reference.keys) and torch.equal(moved.values, reference.values)


def test_the_flag_reaches_the_model_config_and_other_forwards_refuse_it():
    model_config, _, _ = settings_from_args(build_parser().parse_args(["generate", "--cache-type", "f16", "x"]))
    assert model_config.cache_type == "f16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--cache-type", "q4", "x"])
    with pytest.raises(ValueError, match="unknown cache type"):
        ModelConfig(cache_type="bf16").validate()
    with pytest.raises(CodespecError, match="lean forward"):
        forward_path(tiny_arch_model("llama", dtype=torch.float32), lean=False, cache_type="f16")
    with pytest.raises(CodespecError, match="CPUs in float32"):
        forward_path(tiny_arch_model("llama"), cache_type="f16")  # float64


def test_auto_keeps_float16_where_the_kernel_reads_it_and_the_models_dtype_elsewhere():
    assert forward_path(tiny_arch_model("llama", dtype=torch.float32)).new_cache().keys.dtype == torch.float16
    assert forward_path(tiny_arch_model("llama")).new_cache().keys.dtype == torch.float64  # no kernel for float64
    path = forward_path(tiny_arch_model("llama", dtype=torch.float32), cache_type="f32")
    assert path.new_cache().keys.dtype == torch.float32
    path.use_cache_type("auto")
    assert path.new_cache().keys.dtype == torch.float16
