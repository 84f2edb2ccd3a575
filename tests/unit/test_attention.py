"""The CPU attention kernel for sequences with few rows: PyTorch's attention, read straight from the caches."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from codespec.forward.kernels import attention
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
    width = attention.padded_width(max(start + count for start, count in shapes))  # the tiles write 16 keys a time
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


def test_float32_cpu_forwards_send_sequences_of_up_to_16_rows_to_the_kernel_and_the_rest_to_pytorch(monkeypatch):
    lean = LeanLlama(tiny_model(dtype=torch.float32))
    assert lean.few_rows_kernel == attention.ready()  # on where numba has a thread pool that pays (OpenMP here)
    assert not LeanLlama(tiny_model()).few_rows_kernel  # float64: PyTorch's attention
    lean.few_rows_kernel = True
    sent = []
    original = attention.make_table
    monkeypatch.setattr(attention, "make_table", lambda rows, *rest: sent.append([len(r.ids) for r in rows])
                        or original(rows, *rest))
    caches = [lean.new_cache() for _ in range(5)]
    fed = [(40, True), (20, False), (16, False), (2, False), (1, True)]  # (rows, a prompt chunk?)
    lean.batch([Rows(cache, list(range(3, 3 + n)), 1, prompt=prompt) for cache, (n, prompt) in zip(caches, fed)])
    assert sent == [[16, 2, 1]]  # the 40-token prompt chunk and the 20-token verify: scaled_dot_product_attention


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


def test_a_first_compile_is_announced_once_and_a_load_from_the_cache_not_at_all(capsys, monkeypatch):
    """The notice comes with numba's compile event (a cache miss), however long loading takes, and only once."""
    import time

    import numba

    monkeypatch.setattr(attention, "_NOTICED", __import__("threading").Event())
    compiled = numba.njit(lambda x: x + 1)
    with attention.compiling_notice():  # loading that compiles nothing, however slowly: nothing said
        time.sleep(1.2)
    assert "compiling" not in capsys.readouterr().err
    with attention.compiling_notice():
        compiled(1)
    with attention.compiling_notice():
        numba.njit(lambda x: x + 2)(1)
        compiled(2)
    assert capsys.readouterr().err.count("compiling the CPU kernels") == 1


def test_a_row_gets_the_same_bits_alone_in_a_verify_and_beside_other_sequences():
    """Batch invariance: the attention of a query row at position p does not depend on the rows after it in its
    sequence (a verify forward), nor on the other sequences of the forward (their lengths set the scores' width)."""
    torch.manual_seed(1)
    layers, heads, kv_heads, dim = 1, 9, 3, 64

    def run(specs):
        """specs: (cache, start, qk rows) per sequence; the attention out [rows, heads, dim]."""
        rows = [Rows(cache, [0] * len(qk), len(qk)) for cache, _, qk in specs]
        for (cache, start, _), r in zip(specs, rows):
            cache.length = start
        firsts = list(itertools.accumulate([len(qk) for _, _, qk in specs], initial=0))[:-1]
        qk = torch.cat([qk for _, _, qk in specs])
        out = torch.empty(qk.shape[0], heads, dim)
        width = attention.padded_width(max(start + len(q) for _, start, q in specs))
        table = attention.make_table(rows, firsts, heads)
        torch.ops.codespec.cached_attention(qk[:, : heads + kv_heads].contiguous(),
                                            qk[:, heads + kv_heads :].contiguous(), out, table, 0, heads, kv_heads,
                                            heads * qk.shape[0], width)
        return out

    for start in (0, 5, 15, 16, 37, 1000):
        cache, other = (StaticCache(layers, kv_heads, dim, 2048, torch.float32, "cpu") for _ in range(2))
        cache.keys.normal_()
        cache.values.normal_()
        other.keys.normal_()
        other.values.normal_()
        qk = torch.randn(5, heads + 2 * kv_heads, dim) / dim ** 0.5
        alone = run([(cache, start, qk[:1])])
        verify = run([(cache, start, qk)])
        beside = run([(other, 1500, torch.randn(3, heads + 2 * kv_heads, dim)), (cache, start, qk[:2])])
        assert torch.equal(alone[0], verify[0])
        assert torch.equal(alone[0], beside[3])
        second = run([(cache, start + 1, qk[1:2])])  # the verify's second row, as the next one-token forward
        assert torch.equal(second[0], verify[1])


def test_rows_past_the_end_of_a_cache_are_refused_before_the_kernel_writes_them():
    cache = StaticCache(1, 1, 16, 32, torch.float32, "cpu")
    cache.length = 30
    attention.make_table([Rows(cache, [0, 0], 2)], [0], 1)  # fills it exactly
    with pytest.raises(ValueError, match="overflow a cache of 32"):
        attention.make_table([Rows(cache, [0, 0, 0], 3)], [0], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("count", [8, 1])
def test_a_pairs_query_rows_split_between_threads_give_the_bits_of_one_task(dtype, count):
    """One sequence's 3 KV heads on 2 threads would leave a thread idle a third of the time: `_attend` splits each
    (sequence, KV head)'s query rows into parts where the pairs do not share out evenly (8 rows a sequence: every
    pair; decoding's 1: the pair left over, a part at the end of each thread's run); every row gets the same bits as
    when its pair is one task, for any number of parts, and the new keys and values are written once."""
    torch.manual_seed(2)
    heads, kv_heads, dim, start = 9, 3, 64, 700
    rows = heads * count
    qk = torch.randn(count, heads + kv_heads, dim) / dim ** 0.5
    v = torch.randn(count, kv_heads, dim)
    width = attention.padded_width(start + count)
    outs = []
    for threads in (1, 2, 3, 5, 100):
        cache = StaticCache(1, kv_heads, dim, 1024, dtype, "cpu")
        torch.manual_seed(3)
        cache.keys.normal_()
        cache.values.normal_()
        cache.length = start
        table = attention.make_table([Rows(cache, [0] * count, count)], [0], heads)
        tasks = attention.schedule(table.numpy(), kv_heads, heads // kv_heads, threads).tolist()
        if threads in (1, 3):
            assert tasks == [[pair, 0, 1] for pair in range(kv_heads)]
        elif count == 8:
            assert tasks == [[pair, part, threads] for pair in range(kv_heads) for part in range(threads)]
        elif threads == 2:
            assert tasks == [[0, 0, 1], [2, 0, 2], [1, 0, 1], [2, 1, 2]]
        assert sorted(map(tuple, tasks)) == sorted(set(map(tuple, tasks)))  # no part twice
        scores, weights = (torch.empty(rows, width) for _ in range(2))
        out = torch.full((count, heads, dim), float("nan"))
        attention._attend(qk.numpy(), v.numpy(), table.numpy(), 0, heads, kv_heads, scores.numpy(), weights.numpy(),
                          out.numpy(), attention.attention_tiles.kernels(dim), threads)
        assert torch.equal(cache.keys[0, :, start : start + count], qk[:, heads:].transpose(0, 1).to(dtype))
        outs.append(out)
    assert not outs[0].isnan().any()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def _filled(layers: int, kv_heads: int, dim: int, dtype, capacity: int = 1024) -> StaticCache:
    """A cache of random keys and values (q8: random floats quantised as the kernel writes them)."""
    cache = StaticCache(layers, kv_heads, dim, capacity, dtype, "cpu")
    if dtype == torch.int8:
        for layer in range(layers):
            attention.write_q8(cache.keys[layer].numpy(), cache.values[layer].numpy(),
                               *(torch.randn(capacity, kv_heads, dim).numpy() for _ in range(2)), 0)
    else:
        cache.keys.normal_()
        cache.values.normal_()
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_a_forked_cache_reads_its_prompt_from_the_source_and_gets_the_bits_of_its_own_copy(dtype):
    """Alternatives of one prompt (Session.fork) copy its keys and values; the kernel reads the copied positions (a
    multiple of 16) from the source, which other tasks of the layer then find in cache, and the rest from the fork's
    own cache: every row's attention has the bits it has when the fork reads only its own copy. A rewrite of either
    cache below the copied count (`changed`) shortens what is read from the source."""
    if dtype == torch.int8 and attention.attention_tiles.q8_instruction_set() is None:
        pytest.fail("this CPU runs no q8 cache attention")  # (every CPU CI runs on has AVX2)
    torch.manual_seed(4)
    layers, heads, kv_heads, dim, prompt = 2, 9, 3, 64, 700
    source = _filled(layers, kv_heads, dim, dtype)
    source.length = prompt + 5  # the source went on past the prompt with its own tokens
    fork, alone = StaticCache(layers, kv_heads, dim, 1024, dtype, "cpu"), _filled(layers, kv_heads, dim, dtype)
    alone.keys[:, :, :prompt] = source.keys[:, :, :prompt]  # the same copy, read only from itself
    alone.values[:, :, :prompt] = source.values[:, :, :prompt]
    fork.keys.copy_(alone.keys)
    fork.values.copy_(alone.values)
    fork.follow(source, prompt)
    for length, count in ((prompt, 3), (prompt + 9, 1), (prompt + 20, 8)):
        fork.length = alone.length = length
        assert fork.shared_prefix() == (source, prompt // 16 * 16)
        outs = []
        for cache in (fork, alone):  # beside two rows of the source's own
            torch.manual_seed(length)
            qk = torch.randn(2 + count, heads + kv_heads, dim) / dim ** 0.5
            v = torch.randn(2 + count, kv_heads, dim)
            table = attention.make_table([Rows(source, [0] * 2, 2), Rows(cache, [0] * count, count)], [0, 2], heads)
            assert table[1, 11].item() == (prompt // 16 * 16 if cache is fork else 0)
            width = attention.padded_width(max(length + count, source.length + 2))
            out = torch.full((2 + count, heads, dim), float("nan"))
            torch.ops.codespec.cached_attention(qk, v, out, table, 1, heads, kv_heads, heads * (2 + count), width)
            outs.append(out[2:])
        assert not outs[0].isnan().any()
        assert torch.equal(outs[0], outs[1])
    source.crop(250)  # the source rewrote its prompt from position 250: the fork reads 240 positions from it
    assert fork.shared_prefix() == (source, 240)
    fork.crop(100)
    assert fork.shared_prefix() == (source, 96)
    fork.changed(10)
    assert fork.shared_prefix() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_alternatives_of_a_prompt_attend_as_one_unit_and_each_row_gets_the_bits_it_gets_alone(dtype):
    """A source and the alternatives forked from it (Session.fork) read one prompt: make_table puts them in one unit
    (adjacent entries, score rows by head, the source reading the prompt from its own cache), whose rows score the
    prompt's keys in one tile call and weigh its values GROUP rows at a time whichever alternative each row is of.
    Every row, for any number of threads (parts cutting through the alternatives' rows), gets the bits it gets when
    its sequence is alone in the forward, reading only its own cache; an alternative past what it shares with the
    source (a shorter shared count) is a unit of its own."""
    if dtype == torch.int8 and attention.attention_tiles.q8_instruction_set() is None:
        pytest.fail("this CPU runs no q8 cache attention")
    torch.manual_seed(5)
    layers, heads, kv_heads, dim, prompt = 2, 9, 3, 64, 300
    source = _filled(layers, kv_heads, dim, dtype)
    forks = [StaticCache(layers, kv_heads, dim, 1024, dtype, "cpu") for _ in range(4)]
    alone = [_filled(layers, kv_heads, dim, dtype) for _ in forks]
    for fork, copy, length in zip(forks, alone, (prompt, prompt + 7, prompt + 30, prompt)):
        copy.keys[:, :, :prompt] = source.keys[:, :, :prompt]
        copy.values[:, :, :prompt] = source.values[:, :, :prompt]
        fork.keys.copy_(copy.keys)
        fork.values.copy_(copy.values)
        fork.follow(source, prompt)
        fork.length = copy.length = length
    forks[3].changed(100)  # rewrote its copy from 100 on: it shares 96 positions, alone in a unit
    source.length = prompt + 5
    counts = [2, 1, 3, 8, 2]  # the source's rows, then each fork's
    batch = [source, *forks]
    qk = torch.randn(sum(counts), heads + kv_heads, dim) / dim ** 0.5
    v = torch.randn(sum(counts), kv_heads, dim)
    firsts = list(itertools.accumulate(counts, initial=0))[:-1]
    table = attention.make_table([Rows(c, [0] * n, n) for c, n in zip(batch, counts)], firsts, heads)
    prefix = prompt // 16 * 16
    assert table[:, 12].tolist() == [0, 0, 0, 0, 4] and table[:, 13].tolist() == [14, 14, 14, 14, 2]
    assert table[:, 14].tolist() == [0, 2, 3, 6, 0] and table[:, 11].tolist() == [prefix] * 4 + [96]
    width = attention.padded_width(max(c.length + n for c, n in zip(batch, counts)))
    expected = []  # each sequence alone (the source too), from its own cache's copy
    source_copy = _filled(layers, kv_heads, dim, dtype)
    source_copy.keys.copy_(source.keys)
    source_copy.values.copy_(source.values)
    source_copy.length = source.length
    for cache, first, count in zip([source_copy, *alone], firsts, counts):
        length = cache.length
        out = torch.full((count, heads, dim), float("nan"))
        own = attention.make_table([Rows(cache, [0] * count, count)], [0], heads)
        assert own[0, 11].item() == 0
        torch.ops.codespec.cached_attention(qk[first : first + count].contiguous(), v[first : first + count].contiguous(),
                                            out, own, 1, heads, kv_heads, heads * count, width)
        cache.length = length
        expected.append(out)
    expected = torch.cat(expected)
    assert not expected.isnan().any()
    for threads in (1, 2, 3, 7):
        scores, weights = (torch.empty(heads * sum(counts), width) for _ in range(2))
        out = torch.full((sum(counts), heads, dim), float("nan"))
        attention._attend(qk.numpy(), v.numpy(), table.numpy(), 1, heads, kv_heads, scores.numpy(), weights.numpy(),
                          out.numpy(), attention.attention_tiles.kernels(dim), threads)
        assert torch.equal(out, expected)
