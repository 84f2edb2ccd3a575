"""The CPU attention kernel for sequences with few rows: PyTorch's attention, read straight from the caches."""

import pytest
import torch
import torch.nn.functional as F

from codespec import attention
from codespec.forward import LeanLlama, Rows, StaticCache
from tests.tiny import tiny_arch_model, tiny_model


def reference(cache: StaticCache, layer: int, q: torch.Tensor, start: int) -> torch.Tensor:
    """PyTorch's grouped-query attention of q [count, heads, dim] at positions start.. against the cache."""
    count, end = q.shape[0], start + q.shape[0]
    mask = torch.zeros(count, end)
    mask[:, start:] = torch.full((count, count), float("-inf")).triu(1)
    keys, values = cache.keys[layer, :, :end], cache.values[layer, :, :end]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                         scale=1.0, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 1, 32)])
def test_the_kernel_computes_grouped_query_attention_of_every_sequence_in_the_table(heads, kv_heads, dim):
    torch.manual_seed(0)
    layers = 3
    # sequences of several lengths, one or two rows each, one starting at position 0 and one past 1,024
    shapes = [(0, 1), (5, 2), (37, 1), (300, 2), (1030, 1), (2047, 2)]
    caches, rows, qk_parts = [], [], []
    for start, count in shapes:
        cache = StaticCache(layers, kv_heads, dim, 1024, torch.float32, "cpu")
        cache.reserve(start + count)
        cache.keys.normal_()
        cache.values.normal_()
        cache.length = start
        caches.append(cache)
        rows.append(Rows(cache, [0] * count, count))
        qk_parts.append(torch.randn(count, heads + kv_heads, dim) / dim ** 0.5)  # q carries the 1/sqrt(dim)
    qk = torch.cat(qk_parts)
    firsts = [sum(count for _, count in shapes[:i]) for i in range(len(shapes))]
    table = attention.make_table(rows, firsts, heads)
    width = max(start + count for start, count in shapes)
    for layer in range(layers):
        out = torch.full((qk.shape[0], heads, dim), float("nan"))
        new_values = torch.randn(qk.shape[0], kv_heads, dim)
        torch.ops.codespec.cached_attention(qk, new_values, out, table, layer, heads, kv_heads, heads * qk.shape[0],
                                            width)
        for cache, q, first, (start, count) in zip(caches, qk_parts, firsts, shapes):
            # the new rows' keys and values went into the cache at their positions
            assert torch.equal(cache.keys[layer, :, start : start + count], q[:, heads:].transpose(0, 1))
            assert torch.equal(cache.values[layer, :, start : start + count],
                               new_values[first : first + count].transpose(0, 1))
            expected = reference(cache, layer, q[:, :heads], start)
            assert (out[first : first + count] - expected).abs().max().item() < 1e-5


def test_float32_cpu_forwards_send_sequences_with_few_rows_to_the_kernel_and_the_rest_to_pytorch(monkeypatch):
    lean = LeanLlama(tiny_model(dtype=torch.float32))
    assert lean.few_rows_kernel == attention.ready()  # on where numba has a thread pool that pays (OpenMP here)
    assert not LeanLlama(tiny_model()).few_rows_kernel  # float64: PyTorch's attention
    lean.few_rows_kernel = True
    sent = []
    original = attention.make_table
    monkeypatch.setattr(attention, "make_table", lambda rows, *rest: sent.append([len(r.ids) for r in rows])
                        or original(rows, *rest))
    caches = [lean.new_cache() for _ in range(3)]
    lean.batch([Rows(cache, list(range(3, 3 + n)), 1) for cache, n in zip(caches, (40, 2, 1))])
    assert sent == [[2, 1]]  # the 40-token prompt went to scaled_dot_product_attention


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_with_the_kernel_a_batch_gives_each_sequence_what_pytorch_attention_gives_it_alone(kind):
    """float32 decoding and short verifies of three sessions in one forward, against each alone without the
    kernel: the logits agree to float rounding and so does every greedy choice."""
    model = tiny_arch_model(kind, dtype=torch.float32)
    lean = LeanLlama(model)
    prompts = [list(range(3, 60)), [5, 6, 7], list(range(50, 300))]
    steps = [[[41], [8, 9], [61, 62]], [[42, 43], [10], [63]], [[44], [11], [64, 65]]]
    alone, together = [lean.new_cache() for _ in prompts], [lean.new_cache() for _ in prompts]
    for prompt, one, other in zip(prompts, alone, together):
        lean(one, prompt, 1)
        lean(other, prompt, 1)
    for fed in steps:
        lean.few_rows_kernel = False
        expected = [lean(cache, ids, len(ids)) for cache, ids in zip(alone, fed)]
        lean.few_rows_kernel = True
        batched = lean.batch([Rows(cache, ids, len(ids)) for cache, ids in zip(together, fed)])
        for want, got in zip(expected, batched):
            assert (got - want).abs().max().item() < 1e-4
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_slow_first_compile_is_announced_once(capsys, monkeypatch):
    import time

    monkeypatch.setattr(attention, "_NOTICED", __import__("threading").Event())
    with attention.compiling_notice(seconds=0.0):
        time.sleep(0.2)
    with attention.compiling_notice(seconds=0.0):
        time.sleep(0.2)
    with attention.compiling_notice(seconds=5.0):  # done before the notice is due: nothing said
        pass
    assert capsys.readouterr().err.count("compiling the CPU kernels") == 1
