"""--cache-type q8: each cached key and value (a head's numbers) rounded to 8-bit integers with one float32 scale, as
llama.cpp's q8_0 cache types; attention.py scores them against queries rounded alike, in exact integer sums."""

import ctypes

import numpy as np
import pytest
import torch
import transformers

from codespec.forward.kernels import attention, attention_tiles, capabilities, native
from codespec.cli.options import build_parser, settings_from_args
from codespec.forward.kernels import q8_tiles
from codespec.errors import CodespecError
from codespec.forward import Rows, StaticCache, forward_path
from tests.tiny import VOCAB, tiny_arch_model, tiny_config
from tests.unit.test_cache_type import attend_once, causal, greedy_agrees
from tests.gguf_files import write_gguf


def rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., dim] as the cache rounds it: integers and the float32 scale of each row (its largest magnitude times
    float32(1 / 127))."""
    top = x.abs().amax(-1, keepdim=True)
    factor = torch.full_like(top, 127.0) / top  # (not 127.0 / top: PyTorch takes that as reciprocal(top) * 127)
    return torch.round(x * factor), top * torch.tensor(1.0 / 127.0)


def q8_model(seed: int = 0) -> transformers.LlamaForCausalLM:
    """A tiny model with a head size of 64 (the q8 tiles take multiples of 64): 2 heads of 64, one KV head."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**tiny_config(VOCAB, 512), "hidden_size": 128, "num_attention_heads": 2,
                                         "num_key_value_heads": 1})
    return transformers.LlamaForCausalLM(config).float().eval()


@pytest.mark.needs_kernels("q8 cache attention")
def test_keys_values_and_queries_are_rounded_to_8_bits_and_scored_in_exact_integers():
    torch.manual_seed(3)
    heads, kv_heads, dim = 9, 3, 64
    for start, count in ((0, 1), (21, 3), (700, 2)):
        cache = StaticCache(1, kv_heads, dim, 1024, torch.int8, "cpu")
        assert cache.keys.shape == (1, kv_heads, 1024, dim + 4)  # 64 integers and a 4-byte scale: 53% of float16
        old_keys, old_values = torch.randn(start, kv_heads, dim), torch.randn(start, kv_heads, dim)
        attention.write_q8(cache.keys[0].numpy(), cache.values[0].numpy(), old_keys.numpy(), old_values.numpy(), 0)
        cache.length = start
        qk, new_values, out = attend_once(cache, heads, count)
        end = start + count
        written = StaticCache(1, kv_heads, dim, 1024, torch.int8, "cpu")  # the prompt path's writes: the same bytes
        attention.write_q8(written.keys[0].numpy(), written.values[0].numpy(), qk[:, heads:].contiguous().numpy(),
                           new_values.numpy(), start)
        assert torch.equal(cache.keys[0, :, start:end], written.keys[0, :, start:end])
        assert torch.equal(cache.values[0, :, start:end], written.values[0, :, start:end])
        keys = attention.dequantized(cache.keys[0, :, :end], keys=True)
        values = attention.dequantized(cache.values[0, :, :end], keys=False)
        integers, scales = rounded(qk[:, heads:].transpose(0, 1))
        assert torch.equal(keys[:, start:], integers * scales)  # stored plus 128, read back exactly
        assert (keys[:, start:] - qk[:, heads:].transpose(0, 1)).abs().le(scales / 2 + 1e-7).all()  # half a step
        integers, scales = rounded(qk[:, :heads])
        expected = causal(integers * scales, keys, values, start)
        assert (out - expected).abs().max().item() < 1e-5


def q8_rows(integers: np.ndarray, scales: np.ndarray, key: bool) -> np.ndarray:
    """Rows as the tiles read them: a key's integers plus 128 (unsigned) then its float32 scale; a query row's
    integers, its scale, then 128 x the sum of its integers (int32)."""
    count, dim = integers.shape
    rows = np.zeros((count, dim + (4 if key else 8)), dtype=np.int8)
    rows[:, :dim] = (integers + 128).astype(np.uint8).view(np.int8) if key else integers
    rows[:, dim : dim + 4] = scales.astype(np.float32).reshape(-1, 1).view(np.int8)
    if not key:
        rows[:, dim + 4 :] = (128 * integers.sum(1)).astype(np.int32).reshape(-1, 1).view(np.int8)
    return rows


@pytest.mark.needs_kernels("q8 cache attention")
def test_the_q8_scores_are_exact_integer_sums_with_the_same_bits_in_every_instruction_set():
    """The q8 cache's scores tile on AVX2 (vpmaddwd) and, where the CPU has it, on AVX512-VNNI (vpdpbusd): each
    score is the exact integer sum of a key's and a row's integers times the key's and the row's scales, in float32,
    bit for bit, extremes (+-127 against +-127 in every lane) included."""
    dim, count, rows = 64, 48, 5
    rng = np.random.default_rng(5)
    keys, queries = rng.integers(-127, 128, (count, dim)), rng.integers(-127, 128, (rows, dim))
    keys[0], keys[1], queries[0], queries[1] = 127, -127, 127, -127
    key_scales = rng.uniform(0.01, 2, count).astype(np.float32)
    query_scales = rng.uniform(0.01, 2, rows).astype(np.float32)
    k, q = q8_rows(keys, key_scales, True), q8_rows(queries, query_scales, False)
    exact = (queries @ keys.T).astype(np.float32)  # (integers: exact in int64, then exactly representable)
    expected = exact * (key_scales[None, :] * query_scales[:, None])
    signature = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_int64)
    ran = []
    for isa, kernel in (("avx2", "q8 cache attention"), ("vnni", "q8 cache attention, vnni")):
        if not capabilities.available(kernel):
            continue
        text, names = attention_tiles.source(dim, isa, most=1, depth_first=isa == "avx2")
        scores = signature(int(native.compile_ir(text, names, kernel)[names.index("scores1")]))
        out = np.zeros((rows, count), dtype=np.float32)
        scores(q.ctypes.data, rows, k.ctypes.data, count, out.ctypes.data, count)
        assert np.array_equal(out.view(np.int32), expected.view(np.int32)), isa
        ran.append(isa)
    assert ran[0] == "avx2" and len(ran) == 1 + capabilities.host_has("avx512vnni")


@pytest.mark.needs_kernels("q8 cache attention")
def test_with_a_q8_cache_a_verify_forward_equals_one_token_forwards_bit_for_bit(tmp_path):
    model = q8_model()
    lean = forward_path(model, gguf=write_gguf(tmp_path / "tiny.gguf", model, permute=True), activations="q8",
                        cache_type="q8")
    prompt, draft = list(range(5, 45)), [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]
    verify, decode, other = lean.new_cache(), lean.new_cache(), lean.new_cache()
    assert verify.keys.dtype == torch.int8
    for cache in (verify, decode):
        lean.batch([Rows(cache, prompt, 1, prompt=True)])  # a prompt chunk: PyTorch's attention, dequantized
    lean(other, list(range(20, 57)), 1)
    together = lean(verify, draft, len(draft))
    alone = torch.cat([lean(decode, [token], 1) for token in draft])
    assert torch.equal(together, alone)
    assert torch.equal(verify.keys[:, :, : verify.length], decode.keys[:, :, : decode.length])
    verify.crop(len(prompt))
    assert torch.equal(lean.batch([Rows(other, [3, 4, 5], 3), Rows(verify, draft[:3], 3)])[1], alone[:3])


@pytest.mark.needs_kernels("q8 cache attention")
def test_speculative_and_plain_greedy_agree_and_differ_from_a_float16_cache_by_rounding(tmp_path, tokenizer):
    model = q8_model(1)
    path = write_gguf(tmp_path / "tiny.gguf", model, permute=True)
    logits = greedy_agrees(model, tokenizer, path, ("q8", "f16"), activations="q8", draft_max=24)
    difference = (logits["q8"] - logits["f16"]).abs().max().item()
    assert 0 < difference < 0.1 * logits["f16"].abs().max().item()


@pytest.mark.needs_kernels("q8 cache attention")
def test_a_move_turns_the_keys_read_back_and_rounds_them_again(tmp_path):
    """A cache-reuse move (llama-server's --cache-reuse) on a q8 cache: each key read as integers times its scale,
    turned in float64, rounded to float32 and to 8 bits again; values as they are.
    Moving up within one cache goes through a copy (a write would reach rows not read yet)."""
    model = q8_model()
    path = forward_path(model, gguf=write_gguf(tmp_path / "tiny.gguf", model, permute=True), activations="q8",
                        cache_type="q8")
    cache = path.new_cache()
    layers, kv_heads, capacity, _ = cache.shape
    for layer in range(layers):
        attention.write_q8(cache.keys[layer].numpy(), cache.values[layer].numpy(),
                           torch.randn(capacity, kv_heads, 64).numpy(), torch.randn(capacity, kv_heads, 64).numpy(), 0)
    for source, target, count in ((300, 7, 500), (100, 400, 300)):
        moved, original = path.new_cache(), cache
        moved.keys.copy_(original.keys), moved.values.copy_(original.values)
        path.move(moved, source, target, count)
        rows = original.keys[:, :, source : source + count]
        keys = (rows[..., :64] ^ -128).double() * rows[..., 64:].contiguous().view(torch.float32).double()
        angles = (target - source) * path.inv_freq.double()
        c, s = torch.cos(angles), torch.sin(angles)  # each pair (x, y) turned as the kernel turns it, in float64
        x, y = keys[..., 0::2], keys[..., 1::2]
        turned = torch.stack([x * c - y * s, x * s + y * c], dim=-1).flatten(-2).float()
        integers, scales = rounded(turned)
        assert torch.equal(attention.dequantized(moved.keys[:, :, target : target + count], keys=True),
                           integers * scales)
        assert torch.equal(moved.values[:, :, target : target + count], original.values[:, :, source : source + count])


def test_the_flag_reaches_the_model_config_and_paths_that_cannot_run_it_refuse_it(tmp_path):
    model_config, _, _ = settings_from_args(build_parser().parse_args(["generate", "--cache-type", "q8", "x"]))
    assert model_config.cache_type == "q8"
    model = q8_model()
    gguf = write_gguf(tmp_path / "tiny.gguf", model, permute=True)
    with pytest.raises(CodespecError, match="activations q8"):
        forward_path(model, gguf=gguf, activations="float32", cache_type="q8")
    with pytest.raises(CodespecError, match="activations q8"):
        forward_path(model, cache_type="q8")  # the checkpoint's weights, not a GGUF's blocks
    small = tiny_arch_model("llama", dtype=torch.float32)  # head size 16
    with pytest.raises(CodespecError, match="multiple of 64" if q8_tiles.available() else "--activations q8 needs a CPU with AVX2"):
        forward_path(small, gguf=write_gguf(tmp_path / "small.gguf", small, permute=True), activations="q8",
                     cache_type="q8")
    with pytest.raises(CodespecError, match="lean forward"):
        forward_path(model, lean=False, cache_type="q8")
