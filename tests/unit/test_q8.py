"""--activations q8: inputs rounded to 8 bits per block of 32 times a GGUF's blocks, exact integer sums (q8_tiles.py)."""

import dataclasses

import numpy as np
import pytest
import torch

from codespec.forward.kernels import block_tiles, capabilities, q8_tiles
from codespec.config import ModelConfig
from codespec.errors import CodespecError
from codespec.forward import Rows, forward_path
from tests.tiny import tiny_arch_model
from gguf import GGMLQuantizationType as Type, quants

from tests.gguf_files import quantize, random_blocks, write_gguf



def rounded_reference(x: np.ndarray) -> np.ndarray:
    """What the kernel multiplies: each block of 32 of a row rounded to rint(x * 127 / max |x|) * max |x| / 127."""
    blocks = x.astype(np.float64).reshape(x.shape[0], -1, 32)
    top = np.abs(blocks).max(axis=2, keepdims=True)
    scale = np.where(top > 0, np.float32(127.0) / top.astype(np.float32), 0).astype(np.float32)
    rounded = np.rint(blocks.astype(np.float32) * scale)
    return (rounded * (top.astype(np.float32) / np.float32(127.0)).astype(np.float64)).reshape(x.shape)


def test_rounding_keeps_each_block_within_half_a_step_and_sums_its_integers():
    x = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
    x[1, 32:64] = 0  # an all-zero block: scale 0, no division by zero
    xq, xd, xs, xh = q8_tiles.rounded8(x, q8_tiles.rounder())
    assert xq.dtype == np.int8 and np.abs(xq).max() == 127
    halves = xq.reshape(3, 6, 16).sum(axis=2).astype(np.float32)  # each half block's sum, times its block's xd
    assert np.array_equal(xh, (xd.repeat(2, axis=1) * halves).astype(np.float32))
    back = xq.astype(np.float64).reshape(3, 3, 32) * xd[:, :, None]
    assert np.all(np.abs(back.reshape(3, 96) - x) <= xd.repeat(32, axis=1) / 2 + 1e-7)
    assert np.array_equal(xs, (xd * xq.reshape(3, 3, 32).sum(axis=2)).astype(np.float32))
    assert not xq[1, 32:64].any() and xd[1, 1] == 0
    many = np.random.default_rng(1).standard_normal((20, 96)).astype(np.float32)  # rounded in parallel
    for got, alone in zip(q8_tiles.rounded8(many, q8_tiles.rounder()), q8_tiles.rounded8(many[7:8], q8_tiles.rounder())):
        assert np.array_equal(got[7:8], alone)
    # every value is float32's IEEE result of the formula, element by element (numpy's, here)
    wide = (many * np.exp(np.random.default_rng(2).standard_normal((20, 96)) * 4)).astype(np.float32)
    wide[3, :32] = 0
    wide[4, 40] = -wide[4, 32:64].__abs__().max() * 2  # the block's largest magnitude negative
    xq, xd, xs, xh = q8_tiles.rounded8(wide[:, :64], q8_tiles.rounder())  # rows of contiguous floats, strided
    blocks = wide[:, :64].reshape(20, 2, 32)
    top = np.abs(blocks).max(axis=2)
    inverse = np.where(top > 0, np.float32(127.0) / np.where(top > 0, top, 1), np.float32(0)).astype(np.float32)
    integers = np.rint(blocks * inverse[:, :, None]).astype(np.int32)
    assert np.array_equal(xq, integers.reshape(20, 64).astype(np.int8))
    assert np.array_equal(xd, top / np.float32(127.0))
    halves = integers.reshape(20, 4, 16).sum(axis=2).astype(np.float32)
    assert np.array_equal(xh, xd.repeat(2, axis=1) * halves)
    assert np.array_equal(xs, xd * integers.sum(axis=2).astype(np.float32))


@pytest.mark.needs_kernels("q8 block tiles")
@pytest.mark.parametrize("kind, outputs, wide", [
    ("Q4_1", 48, False), ("Q4_1", 45, False), ("Q8_0", 40, False), ("Q4_0", 33, False), ("Q4_1", 32, True),
    ("Q8_0", 16, True), ("Q8_M", 35, True), ("Q8_16", 48, True), ("L8mx2o0", 17, True), ("Q8_M", 20, False)])
def test_the_tiles_multiply_the_rounded_rows_by_the_blocks_values_and_a_row_gets_the_same_bits_in_any_batch(
        kind, outputs, wide):
    """Integer sums are exact, and each (row, column) then takes the same float steps in every tile, of one to
    eight rows (VNNI) or one to four (AVX2): 19 rows give each row what it gets alone. 45, 40, 35, 33 and 17
    columns: the last group padded. Extreme blocks too: inputs at +-127 against the largest weights (an AVX2 sum of
    16-bit pairs that could saturate would show here). Every layout runs in both instruction sets (K-quants'
    sub-block scales are float32, `wide`; Q6_K's scale per 16 weights; the mixed layout of a Q4_K_M file's fused
    q/k/v; bytes with a minimum, which the VNNI tiles hold as m - 128 d)."""
    if kind not in block_tiles.KINDS:
        block_tiles.kind_of(block_tiles.Layout(8, True, 2))
    blocks = random_blocks(kind, outputs, 192)
    q, d, m = blocks.integers()
    layout = block_tiles.KINDS[kind]
    q[:3] = {4: 15 - layout.offset, 8: -128}[layout.bits]  # the largest weight magnitudes each layout holds
    if wide:  # scales of more bits than float16's (a K-quant's d times a 6-bit integer)
        d = d * np.float32(1 + 2 ** -20)
    blocks = block_tiles.Blocks.of(kind, q, d, m, blocks.source)
    weight = blocks.weight(q8=True)
    x = np.random.default_rng(1).standard_normal((19, 192)).astype(np.float32)
    x[:4, :64] = np.where(x[:4, :64] > 0, 1.0, -1.0)  # rounded to +-127
    x[4, :], x[5, :] = 1.0, -1.0
    together = q8_tiles.linear(x, weight)
    assert together.shape == (19, outputs)
    expected = rounded_reference(x) @ blocks.values().double().numpy().T
    assert np.abs(together - expected).max() < 1e-5 * np.abs(expected).max()
    for first, count in [(0, 1), (5, 1), (18, 1), (3, 2), (10, 5), (0, 8), (11, 8)]:
        assert np.array_equal(q8_tiles.linear(np.ascontiguousarray(x[first : first + count]), weight),
                              together[first : first + count])


@pytest.mark.parametrize("isa", ["vnni", "avx2"])
def test_the_tiles_hold_float16_scales_where_they_are_float16_values_and_float32_otherwise(monkeypatch, isa):
    """Scales stay float16, as the file has them, unless one is not a float16 value (then float32: `wide`); the
    VNNI tiles hold a byte form's m - 128 d (vpdpbusd reads the stored bytes, the values plus 128, unsigned)."""
    blocks = random_blocks("Q4_1", 16, 64)
    monkeypatch.setattr(q8_tiles, "tiles", lambda form: form)  # (the form, not compiled: either set, on any CPU)
    monkeypatch.setattr(q8_tiles, "instruction_set", lambda: isa)
    assert blocks.weight(q8=True)[2] == q8_tiles.Form(nibbles=True, wide=False)
    blocks.d[0, 0] = 1 / 3  # not a float16 value
    assert blocks.weight(q8=True)[2] == q8_tiles.Form(nibbles=True, wide=True)
    q8_0 = random_blocks("Q8_0", 16, 64)  # (VNNI: m = -128 d, formed in the tile)
    assert q8_0.weight(q8=True)[2] == q8_tiles.Form(nibbles=False, minimum=isa == "vnni", offset=128 * (isa == "vnni"))


@pytest.mark.needs_kernels("q8 block tiles")
@pytest.mark.parametrize("kind", [Type.Q4_0, Type.Q5_0, Type.Q5_1, Type.Q5_K, Type.Q6_K])
def test_five_and_six_bit_files_multiply_exactly_as_planes_of_bits_and_offsets(kind):
    """A file's five- and six-bit blocks (Q5_*, Q6_K): on VNNI and AVX2, nibbles and one or two planes of the higher
    bits (0.625 and 0.75 bytes a weight), on ARM64 bytes; a minimum that is -8, -16 or -32 d is formed in the tile,
    not read. Against the float64 product of the rounded rows and gguf's own dequantisation, and a row alone gets the
    bits it gets among 19."""
    rng = np.random.default_rng(3)
    raw = quantize(rng.standard_normal((40, 512)).astype(np.float32), kind)
    blocks = block_tiles.Blocks.read(type("Tensor", (), {"name": "t", "tensor_type": kind, "data": raw}))
    weight = blocks.weight(q8=True)
    planes = {Type.Q5_0: 1, Type.Q5_1: 1, Type.Q5_K: 1, Type.Q6_K: 2}.get(kind, 0)
    isa = q8_tiles.instruction_set()
    assert blocks.q8_packed(isa)[2].planes == (planes if isa in q8_tiles.PLANES else 0)
    assert blocks.q8_packed(isa)[2].offset == {Type.Q4_0: 8, Type.Q5_0: 16 if isa in q8_tiles.PLANES else 0,
                                                Type.Q6_K: 32 if isa in q8_tiles.PLANES else 0}.get(kind, 0)
    x = rng.standard_normal((19, 512)).astype(np.float32)
    together = q8_tiles.linear(x, weight)
    expected = rounded_reference(x) @ quants.dequantize(raw, kind).astype(np.float64).T
    assert np.abs(together - expected).max() < 1e-5 * np.abs(expected).max()
    for first, count in [(0, 1), (7, 1), (3, 4), (0, 8), (11, 8)]:
        assert np.array_equal(q8_tiles.linear(np.ascontiguousarray(x[first : first + count]), weight),
                              together[first : first + count])
    # the largest weights a block holds (each block's least value too, so signed blocks are held plus 16 or 32)
    # against inputs at +-127: the AVX2 tiles add 16-bit sums of several steps, which would saturate past 32,767
    q, d, m = blocks.integers()
    q[:4], q[:4, :, 0] = q.max(), q.min()
    extreme = block_tiles.Blocks.of(blocks.kind, q, d, m, blocks.source, blocks.base)
    x[:2], x[2:4] = 1.0, -1.0
    got = q8_tiles.linear(x, extreme.weight(q8=True))
    expected = rounded_reference(x) @ extreme.values().double().numpy().T
    assert np.abs(got - expected).max() < 1e-5 * np.abs(expected).max()


@pytest.mark.needs_kernels("q8 block tiles")
@pytest.mark.parametrize("kind", [Type.Q4_K, Type.Q5_K, Type.Q6_K], ids=lambda kind: kind.name)
def test_k_quant_scales_are_held_as_the_files_integers_and_give_the_bits_of_float32_scales(kind, monkeypatch):
    """A K-quant's sub-block scales and minimums are its super-block's float16 d (or dmin) times a 6- or 8-bit
    integer. The tiles hold those integers as bytes and one float32 base per super-block and column, and multiply
    them in the tile (exact), so a weight costs 0.59 bytes in Q4_K (against 0.75 with float32 scales): the outputs
    are the float32 scales' outputs bit for bit, in every instruction set this CPU runs, and a row alone gets the
    bits it gets among 19. Where a scale is no such product (scales not from a K-quant), float32 as before."""
    rng = np.random.default_rng(5)
    raw = quantize(rng.standard_normal((40, 512)).astype(np.float32), kind)
    if kind == Type.Q6_K:  # llama-quantize's signed scales reach -128, int8's least
        raw[:2, 192:196] = 128
    blocks = block_tiles.Blocks.read(type("Tensor", (), {"name": "t", "tensor_type": kind, "data": raw}))
    bits = block_tiles.KINDS[blocks.kind].bits
    x = rng.standard_normal((19, 512)).astype(np.float32)
    expected = rounded_reference(x) @ quants.dequantize(raw, kind).astype(np.float64).T
    for isa, (kernel, _) in q8_tiles.ISAS.items():
        if isa == "neon" or not capabilities.available(kernel):
            continue
        factored = q8_tiles.packed(bits, 40, blocks._q8_integers, isa, blocks.planes())
        wide = q8_tiles.packed(bits, 40, lambda first, last: blocks._q8_integers(first, last)[:3], isa, blocks.planes())
        assert factored[2] == dataclasses.replace(wide[2], wide=False, factored=True) and wide[2].wide
        assert factored[1].nbytes < wide[1].nbytes / 2 and np.array_equal(factored[0], wide[0])
        outputs = []
        for q, held, form, rows, chunk in (factored, wide):
            weight = (q, held, q8_tiles.compiled_tiles(form, isa), rows, chunk)
            outputs.append(q8_tiles.linear(x, weight))
            for first, count in [(0, 1), (7, 1), (3, 4), (11, 8)]:
                assert np.array_equal(q8_tiles.linear(np.ascontiguousarray(x[first : first + count]), weight),
                                      outputs[-1][first : first + count])
        assert np.array_equal(outputs[0], outputs[1]) and outputs[0].shape == (19, 40)
        assert np.abs(outputs[0] - expected).max() < 1e-5 * np.abs(expected).max()
    other = block_tiles.Blocks.of(blocks.kind, *blocks.integers(), blocks.source, blocks.base * 3)  # (not its base)
    assert other.q8_packed(q8_tiles.instruction_set())[2].wide


@pytest.mark.needs_kernels("q8 block tiles")
def test_a_q_k_v_fused_from_q4_k_and_q6_k_blocks_is_held_in_six_bits_with_factored_scales():
    """A Q4_K_M file's q, k (Q4_K) and v (Q6_K in some layers) fused into one projection: on VNNI and AVX2 nibbles
    and two planes with the scales as bytes (0.91 bytes a weight; it was a byte a weight and float32 scales, 1.5),
    on ARM64 bytes with factored scales; against the float64 reference, a row alone as among 19."""
    rng = np.random.default_rng(8)
    parts, raws = [], []
    for kind, rows in ((Type.Q4_K, 32), (Type.Q4_K, 16), (Type.Q6_K, 16)):
        raws.append((quantize(rng.standard_normal((rows, 512)).astype(np.float32), kind), kind))
        parts.append(block_tiles.Blocks.read(type("Tensor", (), {"name": "t", "tensor_type": kind, "data": raws[-1][0]})))
    fused = block_tiles.Blocks.cat(parts)
    isa = q8_tiles.instruction_set()
    form = fused.q8_packed(isa)[2]
    assert form.factored and form.planes == (2 if isa in q8_tiles.PLANES else 0)
    x = rng.standard_normal((19, 512)).astype(np.float32)
    weight = fused.weight(q8=True)
    together = q8_tiles.linear(x, weight)
    reference = np.concatenate([quants.dequantize(raw, kind).astype(np.float64) for raw, kind in raws])
    expected = rounded_reference(x) @ reference.T
    assert np.abs(together - expected).max() < 1e-5 * np.abs(expected).max()
    for first, count in [(0, 1), (9, 1), (2, 4), (11, 8)]:
        assert np.array_equal(q8_tiles.linear(np.ascontiguousarray(x[first : first + count]), weight),
                              together[first : first + count])


@pytest.mark.parametrize("isa", ["vnni", "avx2", "neon"])
def test_the_planes_hold_each_weights_higher_bits_in_the_order_of_its_steps_bytes(monkeypatch, isa):
    """The layout the VNNI tiles read (any CPU: the tiles are not compiled): per block, four steps of nibbles, then
    a plane per bit past the fourth, step s's 64 weights in bits 64 s .. 64 s + 63; the offset form keeps only d.
    The AVX2 tiles' (test_the_avx2_planes_...) hold the same bits shifted into fields; ARM64's tiles hold bytes."""
    monkeypatch.setattr(q8_tiles, "tiles", lambda form: form)
    monkeypatch.setattr(q8_tiles, "instruction_set", lambda: isa)
    rng = np.random.default_rng(4)
    raw = quantize(rng.standard_normal((16, 64)).astype(np.float32), Type.Q5_0)
    blocks = block_tiles.Blocks.read(type("Tensor", (), {"name": "t", "tensor_type": Type.Q5_0, "data": raw}))
    q, held, form, rows, _ = blocks.weight(q8=True)
    values, d, _ = blocks.integers()  # -16..15, one scale a block
    if isa == "neon":  # bytes: the signed values plus 128, no minimum
        assert form == q8_tiles.Form(nibbles=False, minimum=False) and q.shape == (1, 2 * 8 * 64)
        return
    assert form == q8_tiles.Form(nibbles=True, planes=1, offset=16) and form.slots == 1
    assert q.shape == (1, 2 * 5 * 64) and held.shape == (1, 2 * 16 * 2)  # 2 blocks of 320 bytes; d as float16
    unsigned = values + 16
    for block in range(2):
        steps = q[0, block * 320 : block * 320 + 256].reshape(4, 16, 4)
        plane = np.unpackbits(q[0, block * 320 + 256 : block * 320 + 320], bitorder="little").reshape(8, 16, 4)
        if isa == "avx2":  # byte i of vector h: bit p is step p's bit 4 of byte i of its half h (columns 8h..8h + 7)
            fields = np.unpackbits(q[0, block * 320 + 256 : block * 320 + 320], bitorder="little").reshape(2, 8, 4, 8)
            plane = fields.transpose(3, 0, 1, 2).reshape(8, 16, 4)  # [vector, column, weight, bit] -> [step, ...]
        for step in range(8):
            nibbles = steps[step % 4] & 15 if step < 4 else steps[step % 4] >> 4
            got = nibbles | (plane[step] << 4)  # [column, 4 weights]
            assert np.array_equal(got, unsigned[:, block, 4 * step : 4 * step + 4])


def test_the_avx2_planes_hold_six_bit_weights_as_fields_of_two_bits(monkeypatch):
    """Six-bit weights for the AVX2 tiles (any CPU: not compiled): per block four steps of nibbles, then four 32-byte
    vectors; byte i of vector 2 k + h holds, for steps 4 k .. 4 k + 3 (field t: bits 2 t, 2 t + 1), bits 4 and 5
    of byte i of the step's half h, so one shift and one and put a half's bits in place."""
    monkeypatch.setattr(q8_tiles, "tiles", lambda form: form)
    monkeypatch.setattr(q8_tiles, "instruction_set", lambda: "avx2")
    raw = quantize(np.random.default_rng(6).standard_normal((16, 256)).astype(np.float32), Type.Q6_K)
    blocks = block_tiles.Blocks.read(type("Tensor", (), {"name": "t", "tensor_type": Type.Q6_K, "data": raw}))
    q, _, form, _, _ = blocks.weight(q8=True)
    assert form.nibbles and form.planes == 2 and form.offset == 32 and q.shape == (1, 8 * 384)
    unsigned = blocks.integers()[0] + 32  # [16 rows, 8 blocks, 32]
    for block in range(8):
        steps = q[0, block * 384 : block * 384 + 256].reshape(4, 16, 4)
        vectors = q[0, block * 384 + 256 : block * 384 + 384].reshape(2, 2, 8, 4)  # [k, h, column in half, weight]
        for step in range(8):
            nibbles = steps[step % 4] & 15 if step < 4 else steps[step % 4] >> 4
            high = (vectors[step // 4] >> (2 * (step % 4))) & 3  # [h, column in half, weight]
            got = nibbles | (high.reshape(16, 4) << 4)
            assert np.array_equal(got, unsigned[:, block, 4 * step : 4 * step + 4])


@pytest.mark.needs_kernels("q8 block tiles")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_tiny_model_on_rounded_activations_stays_near_the_exact_products(tmp_path, kind):
    """The rounding moves the logits a little (8 bits per block of 32), not to other numbers."""
    model = tiny_arch_model(kind, dtype=torch.float32)
    path = write_gguf(tmp_path / "tiny.gguf", model, permute=kind == "llama")
    rounded = forward_path(model, gguf=path, activations="q8")
    exact = forward_path(model, gguf=path, activations="float32")
    assert rounded.q8 and rounded.reads == "gguf blocks, q8 activations" and not exact.q8
    ids = [5, 17, 3, 99, 42, 7, 8, 9, 11, 12]
    a, b = rounded(rounded.new_cache(), ids, len(ids)), exact(exact.new_cache(), ids, len(ids))
    assert not torch.equal(a, b)
    assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()
    assert torch.equal(a.argmax(dim=-1), b.argmax(dim=-1))


@pytest.mark.parametrize("activations", [pytest.param("q8", marks=pytest.mark.needs_kernels("q8 block tiles")), "float32"])
def test_with_q8_a_prompt_chunk_and_a_long_verify_stay_in_numba(tmp_path, activations):
    """With q8 activations every forward runs the q8 tiles (PyTorch's float32 products would give other logits);
    with float32 ones, forwards over more than layers.FEW_ROWS rows go to PyTorch's path."""
    model = tiny_arch_model("llama", dtype=torch.float32)
    lean = forward_path(model, gguf=write_gguf(tmp_path / "tiny.gguf", model, permute=True), activations=activations)
    used = []
    lean.run_layers = lambda *args: used.append(len(args[0])) or args[0]
    cache = lean.new_cache()
    lean.batch([Rows(cache, list(range(40)), 1, prompt=True)])
    lean.batch([Rows(cache, list(range(24)), 24)])
    assert cache.length == 64
    assert used == ([] if activations == "q8" else [40, 24])


def test_q8_is_refused_where_it_cannot_run(tmp_path):
    model = tiny_arch_model("llama", dtype=torch.float32)
    with pytest.raises(CodespecError, match="--activations q8 multiplies a GGUF's blocks"):
        forward_path(model, activations="q8")  # the checkpoint's weights
    path = write_gguf(tmp_path / "tiny.gguf", model, permute=True)
    with pytest.raises(CodespecError, match="lean forward"):
        forward_path(tiny_arch_model("gemma3", dtype=torch.float32), activations="q8")
    with pytest.raises(ValueError, match="unknown activations 'int4'"):
        ModelConfig(activations="int4").validate()
    assert forward_path(model, gguf=path, activations="auto").q8 == q8_tiles.available()  # auto: q8 on a CPU with VNNI
    if q8_tiles.available():
        with pytest.raises(CodespecError, match="--prompt-precision bfloat16 multiplies prompts in PyTorch"):
            forward_path(model, gguf=path, prompt_precision="bfloat16", activations="q8")
        assert forward_path(model, gguf=path, prompt_precision="auto", activations="q8").prompt_weights is None
    else:  # a CPU with neither AVX2 nor ARM64's dot product: a one-line refusal, never an abort
        with pytest.raises(CodespecError, match="--activations q8 needs a CPU with AVX2"):
            forward_path(model, gguf=path, activations="q8")
    assert forward_path(model, gguf=path, prompt_precision="bfloat16", activations="float32").prompt_weights


@pytest.mark.needs_kernels("q8 block tiles")
def test_speculative_and_plain_greedy_agree_on_rounded_activations_with_long_drafts(tmp_path, tokenizer):
    """Drafts of up to 32 tokens: verify forwards past layers.FEW_ROWS rows, still the tokens of decoding alone."""
    from codespec.config import SamplingParams, SpecConfig
    from codespec.engine import Engine

    model = tiny_arch_model("llama", dtype=torch.float32)
    engine = Engine(model, tokenizer, SpecConfig(), eos_token_ids=frozenset({10**9}),  # no end of text: 60 tokens
                    gguf=write_gguf(tmp_path / "tiny.gguf", model, permute=True), activations="q8")
    engine.costs  # measured first (forwards of its own)
    rows, batch = [], engine.path.batch
    engine.path.batch = lambda requests: rows.append(sum(len(r.ids) for r in requests if not r.prompt)) or batch(
        requests)  # the rows of each forward but prompt chunks
    prompt = list(range(10, 50)) * 3
    params = SamplingParams(max_tokens=60)
    plain = engine.generate(prompt, params, spec=SpecConfig(spec=("none",)))
    assert max(rows) == 1 and len(plain.tokens) == 60
    rows.clear()
    spec = engine.generate(prompt, params, spec=SpecConfig(spec=("prompt-lookup",), draft_max=32, adaptive=False))
    assert max(rows) > 16  # a verify forward of more rows than layers.FEW_ROWS
    assert spec.tokens == plain.tokens


@pytest.mark.needs_kernels("q8 block tiles")
def test_q8_keeps_one_copy_of_the_weights_and_reads_the_blocks_again_for_float_activations(tmp_path):
    """The repacked copies replace the file's blocks (a load holds one copy); switching to float32 activations on a
    running forward reads the blocks again, and each setting gives the logits of a forward built with it."""
    model = tiny_arch_model("llama", dtype=torch.float32)
    path = write_gguf(tmp_path / "tiny.gguf", model, permute=True)
    lean = forward_path(model, gguf=path, activations="q8")
    assert lean.blocks is not None and "layers" not in lean.blocks
    ids = [5, 17, 3, 99, 42, 7]
    for activations in ("float32", "q8"):
        lean.use_activations(activations)
        fresh = forward_path(model, gguf=path, activations=activations)
        assert torch.equal(lean(lean.new_cache(), ids, 2), fresh(fresh.new_cache(), ids, 2))
    assert "layers" not in lean.blocks
