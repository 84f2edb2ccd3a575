"""KV-cache reuse beyond the common prefix (llama-server's --cache-reuse): cached chunks that the new prompt holds
at earlier positions are moved into place, their keys turned by the shift, instead of computed again."""

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from codespec.config import SamplingParams, SpecConfig
from codespec.engine import Engine
from tests.tiny import EOS, VOCAB, tiny_config

PLAIN = SpecConfig(spec=("none",))


def lines(rng, count):
    """`count` lines of 12 random tokens each (random tokens never repeat by chance, so chunks match only where
    the text really is the same)."""
    return [rng.integers(1, VOCAB, size=12).tolist() for _ in range(count)]


def flat(chunks):
    return [t for chunk in chunks for t in chunk]


def engine_with_layers(tokenizer, layers: int, reuse: int) -> Engine:
    config = LlamaConfig(**{**tiny_config(VOCAB, 1024), "num_hidden_layers": layers})
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    return Engine(model, tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}), cache_reuse=reuse)


def last_logits(engine, session_id, prompt):
    """The logits after `prompt` in the session (prepared as a request would), and the tokens it reused."""
    session = engine.session(session_id)
    reused = session.prepare(prompt)
    logits = engine.path(session.cache, session.pending, 1)[-1]
    return logits, reused


def slid(tokenizer, layers: int, seed: int, before: slice, after: slice):
    """A session that held lines[before] is asked for lines[after]: (lines, engine, tokens reused, max |logit
    difference| from a cold prefill of the same prompt)."""
    text = lines(np.random.default_rng(seed), 40)
    engine = engine_with_layers(tokenizer, layers=layers, reuse=16)
    last_logits(engine, "editor", flat(text[before]))
    reused_logits, reused = last_logits(engine, "editor", flat(text[after]))
    cold_logits, cold_reused = last_logits(engine, "k9|cold", flat(text[after]))  # another namespace: no donors
    assert cold_reused == 0
    return text, engine, reused, (reused_logits - cold_logits).abs().max().item(), cold_logits


def test_a_window_that_slides_down_reuses_the_moved_lines_and_one_layer_is_exact(tokenizer):
    """One decoder layer: keys and values depend only on the token and its position, so a moved chunk whose keys
    are turned by the shift is the recomputation, up to rounding. The window drops 3 lines at the top and gains
    2 at the bottom: everything but the new lines is reused."""
    text, _, reused, difference, _ = slid(tokenizer, 1, 1, slice(0, 30), slice(3, 32))
    assert reused == len(flat(text[3:30]))  # every line still in the window
    print(f"1 layer, float64: max |logit difference| after moving {reused} tokens: {difference:.2e}")
    assert difference < 1e-5  # the rotary tables are float32 (as transformers computes them): ~1e-7 per angle


def test_deeper_layers_differ_from_a_cold_prefill_and_the_history_is_the_new_prompt(tokenizer):
    """Two layers: the moved lines keep the attention they paid to the dropped lines, as in llama-server, so the
    logits differ from a cold prefill by more than rounding; the test states by how much. (A random tiny model's
    greedy output can follow that difference: the default model's identity on real code is an integration
    test.) The session's history is the new prompt and its drafters relearn it, so speculation stays exact with
    respect to the reused cache: speculative and plain decoding of it agree."""
    text, engine, reused, difference, cold_logits = slid(tokenizer, 2, 2, slice(0, 30), slice(2, 31))
    before, after = flat(text[:30]), flat(text[2:31])
    assert reused == len(flat(text[2:30]))
    print(f"2 layers, float64: max |logit difference| after a 2-line slide: {difference:.2e} "
          f"(logits span {cold_logits.min().item():.1f}..{cold_logits.max().item():.1f})")
    assert 1e-5 < difference < 2.0

    params = SamplingParams(max_tokens=24)
    results = {}
    for spec in (PLAIN, SpecConfig(spec=("prompt-lookup",))):
        name = ",".join(spec.spec)
        engine.generate(before, params, session_id=name, spec=spec)
        results[name] = engine.generate(after, params, session_id=name, spec=spec)
        assert results[name].stats.cached_tokens == reused
        assert engine.sessions[name].history.tolist() == after + results[name].tokens
    assert results["none"].tokens == results["prompt-lookup"].tokens


def test_reuse_is_off_by_default_and_a_deleted_block_above_the_cursor_is_skipped(tokenizer):
    rng = np.random.default_rng(3)
    text = lines(rng, 20)
    before = flat(text)
    edited = flat(text[:5] + text[9:] + [[7, 8, 9]])  # lines 5..8 deleted above the cursor
    off = engine_with_layers(tokenizer, layers=1, reuse=0)
    last_logits(off, "s", before)
    assert last_logits(off, "s", edited)[1] == len(flat(text[:5]))  # the common prefix only
    on = engine_with_layers(tokenizer, layers=1, reuse=16)
    last_logits(on, "s", before)
    assert last_logits(on, "s", edited)[1] == len(flat(text[:5] + text[9:]))
    short = engine_with_layers(tokenizer, layers=1, reuse=200)  # chunks shorter than the minimum stay cold
    last_logits(short, "s", before)
    assert last_logits(short, "s", edited)[1] == len(flat(text[:5]))


def test_a_chunk_may_start_a_few_tokens_later_and_those_are_computed(tokenizer):
    """A line that now opens the window tokenises differently without the newline before it: the run of cached
    tokens starts a few prompt tokens in. Those few are computed (one small forward), the rest is moved, and with
    one layer the result is still the recomputation."""
    rng = np.random.default_rng(4)
    text = lines(rng, 30)
    before, after = flat(text[:25]), [5, 6] + flat(text[3:27])
    engine = engine_with_layers(tokenizer, layers=1, reuse=16)
    last_logits(engine, "editor", before)
    reused_logits, reused = last_logits(engine, "editor", after)
    cold_logits, _ = last_logits(engine, "k9|cold", after)
    assert reused == len(flat(text[3:25]))  # the two new tokens are not counted as reused
    assert (reused_logits - cold_logits).abs().max().item() < 1e-5


def test_the_cpu_kernel_moves_exactly_as_pytorch_does(tokenizer):
    """On CPUs in float32 a move runs in numba, in place (attention.move_cached): the same turned keys, bit for bit,
    as the PyTorch rotation in float64 that other devices and dtypes take, and the values unchanged. The chunk
    moved overlaps where it came from, as when a window slides by a few lines."""
    config = LlamaConfig(**{**tiny_config(VOCAB, 1024), "num_hidden_layers": 2})
    torch.manual_seed(5)
    engine = Engine(LlamaForCausalLM(config).eval(), tokenizer, PLAIN, eos_token_ids=frozenset({EOS}))
    path = engine.path
    assert path.few_rows_kernel  # the numba path is the one under test
    moved, reference = path.new_cache(), path.new_cache()
    moved.keys.normal_(), moved.values.normal_()
    reference.keys.copy_(moved.keys), reference.values.copy_(moved.values)
    keys, values = moved.keys.clone(), moved.values.clone()
    path.move(moved, 300, 7, 500)
    path.few_rows_kernel = False  # the PyTorch rotation
    path.move(reference, 300, 7, 500)
    assert torch.equal(moved.keys, reference.keys)
    assert torch.equal(moved.values, reference.values)
    assert torch.equal(moved.values[:, :, 7:507], values[:, :, 300:800])
    assert not torch.equal(moved.keys[:, :, 7:507], keys[:, :, 300:800])  # the keys did turn


def test_a_prompt_borrows_chunks_from_another_sessions_cache_and_one_layer_is_exact(tokenizer):
    """llama.vim's :LlamaInstruct: a chat prompt in another slot holds, after its own header, the lines the FIM
    slot cached, and between them the selection. Those chunks are copied from the FIM slot's cache (turned to
    their new positions, here later ones) and only the rest is computed; with one layer, that is the
    recomputation. The FIM slot keeps its cache."""
    rng = np.random.default_rng(6)
    text, header, middle = lines(rng, 30), [5, 6, 7] * 9, [9, 8] * 10
    engine = engine_with_layers(tokenizer, layers=1, reuse=16)
    fim = flat(text)
    last_logits(engine, "slot-0", fim)
    instruct = header + flat(text[2:20]) + middle + flat(text[20:28]) + [3, 4]
    borrowed_logits, reused = last_logits(engine, "slot-1", instruct)
    assert reused == len(flat(text[2:20] + text[20:28]))
    cold_logits, cold_reused = last_logits(engine, "k9|cold", instruct)
    assert cold_reused == 0
    assert (borrowed_logits - cold_logits).abs().max().item() < 1e-5
    assert engine.sessions["slot-0"].history.tolist() == fim and engine.sessions["slot-0"].cached == len(fim)
    assert engine.sessions["slot-1"].history.tolist() == instruct


def test_a_session_borrows_from_its_own_cache_at_later_positions(tokenizer):
    """The first :LlamaInstruct goes to slot 0, where the FIM prompt sits: its lines come after the chat header,
    at later positions than they were cached at, which an in-place move (leftwards only) cannot do; a fresh cache
    takes them from the old one."""
    rng = np.random.default_rng(7)
    text, header = lines(rng, 25), [5, 6, 7] * 8
    engine = engine_with_layers(tokenizer, layers=1, reuse=16)
    last_logits(engine, "slot-0", flat(text))
    prompt = header + flat(text[1:24]) + [3, 4]
    borrowed_logits, reused = last_logits(engine, "slot-0", prompt)
    assert reused == len(flat(text[1:24]))
    cold_logits, _ = last_logits(engine, "k9|cold", prompt)
    assert (borrowed_logits - cold_logits).abs().max().item() < 1e-5


def test_sessions_of_other_api_keys_lend_nothing_and_reuse_off_borrows_nothing(tokenizer):
    rng = np.random.default_rng(8)
    text, header = lines(rng, 20), [5, 6, 7] * 8
    prompt = header + flat(text) + [3]
    engine = engine_with_layers(tokenizer, layers=1, reuse=16)
    last_logits(engine, "k0|slot-0", flat(text))
    assert last_logits(engine, "k1|slot-0", prompt)[1] == 0  # another key's namespace
    assert last_logits(engine, "k0|slot-1", prompt)[1] == len(flat(text))
    off = engine_with_layers(tokenizer, layers=1, reuse=0)
    last_logits(off, "slot-0", flat(text))
    assert last_logits(off, "slot-1", prompt)[1] == 0


def test_speculation_stays_exact_over_a_borrowed_cache(tokenizer):
    """Two layers: borrowed chunks differ from a cold prefill (as moved ones do), and speculative and plain
    decoding of the same borrowed cache still agree."""
    rng = np.random.default_rng(9)
    text, header = lines(rng, 30), [5, 6, 7] * 8
    prompt = header + flat(text[3:28]) + [3, 4]
    params = SamplingParams(max_tokens=24)
    results = {}
    for spec in (PLAIN, SpecConfig(spec=("prompt-lookup",))):
        engine = engine_with_layers(tokenizer, layers=2, reuse=16)
        engine.generate(flat(text), params, session_id="slot-0", spec=spec)
        results[spec.spec] = engine.generate(prompt, params, session_id="slot-1", spec=spec)
        assert results[spec.spec].stats.cached_tokens == len(flat(text[3:28]))
    assert results[PLAIN.spec].tokens == results[("prompt-lookup",)].tokens
