"""The embedded default model (SmolLM2-135M-Instruct) in float32: speculation never changes the text."""

import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from codespec.forward.kernels import q8_tiles
from codespec.config import ModelConfig, SamplingParams, SpecConfig
from codespec.forward.models import default_checkpoint, pull

pytestmark = pytest.mark.integration

NONE = SpecConfig(spec=("none",))
LOOKUP = SpecConfig(spec=("prompt-lookup",))
LOOKUP_LONG = SpecConfig(spec=("prompt-lookup",), draft_max=48, ngram_min=1, ngram_max=6)


def edit_prompt() -> str:
    source = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split))
    return f"Rewrite this Python method, renaming `chunks` to `pieces`. Reply with the code only.\n\n```python\n{source}```"


PROMPTS = {
    "edit": (edit_prompt(), True),
    "completion": (textwrap.dedent(inspect.getsource(textwrap.indent))[:400], False),
    "prose": ("Explain in two paragraphs why caching makes software faster.", True),
}


def test_pull_is_idempotent(default_engine):
    path = pull(show_progress=False)
    assert path == default_checkpoint()
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert default_engine.model.config.num_hidden_layers == 30
    assert default_engine.model.dtype == torch.float32


def assert_greedy_identity(engine, name):
    """Speculative greedy output equals plain greedy output, by default (on the GGUF's blocks: activations rounded to
    8 bits; on the checkpoint's weights: long prompts multiplied in bfloat16; keys and values kept in float16 on both)
    and in float32 throughout (--activations float32 --prompt-precision float32 --cache-type f32), where it also
    equals transformers' own generate (with and without its prompt lookup) on the same model."""
    text, chat = PROMPTS[name]
    prompt = engine.encode(text, chat=chat)
    assert len(prompt) > 16  # long enough to go through the weights for prompts
    params = SamplingParams(max_tokens=96)
    blocks = engine.gguf is not None
    try:
        for exact in (False, True):
            if blocks:
                engine.path.use_activations("float32" if exact else "auto")
                assert engine.path.q8 == (not exact and q8_tiles.available())  # (q8: CPUs with AVX512-VNNI)
            # (bfloat16 prompts: PyTorch's path, which --invariant on, the default, leaves for the per-row kernels)
            low = not (exact or blocks or engine.path.invariant)
            engine.path.use_prompt_precision("bfloat16" if low else ("float32" if exact else "auto"))
            engine.path.use_cache_type("f32" if exact else "f16")
            assert (engine.path.prompt_weights is None) == (not low)
            plain = engine.generate(prompt, params, spec=NONE)
            assert len(plain.tokens) > 10
            for spec in (LOOKUP, LOOKUP_LONG):
                fast = engine.generate(prompt, params, spec=spec)
                assert fast.tokens == plain.tokens and fast.text == plain.text, exact
    finally:
        if blocks:
            engine.path.use_activations(ModelConfig.activations)
        engine.path.use_prompt_precision(ModelConfig.prompt_precision)
        engine.path.use_cache_type(ModelConfig.cache_type)
    model = engine.transformers_model  # (read directly from the GGUF: a float32 copy with the file's values)
    for options in ({}, {"prompt_lookup_num_tokens": 10}):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=96, do_sample=False, **options)
        assert out[0, len(prompt):].tolist() == plain.tokens, options
    if name == "edit":  # an edit copies its input: speculation must pay off here
        assert engine.generate(prompt, params, spec=LOOKUP).stats.tokens_per_forward > 2.0


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_identity_on_the_default_model(default_engine, name):
    assert_greedy_identity(default_engine, name)


def test_multi_turn_session_reuses_the_cache(default_engine):
    engine = default_engine
    messages = [{"role": "user", "content": edit_prompt()}]
    first_prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    first = engine.generate(first_prompt, SamplingParams(max_tokens=48), session_id="chat")
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "Now add a docstring."}]
    second_prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    warm = engine.generate(second_prompt, SamplingParams(max_tokens=48), session_id="chat")
    cold = engine.generate(second_prompt, SamplingParams(max_tokens=48), spec=NONE)
    assert warm.tokens == cold.tokens
    assert warm.stats.cached_tokens >= len(first_prompt)


def test_seeded_sampling_is_reproducible(default_engine):
    prompt = default_engine.encode(PROMPTS["prose"][0], chat=True)
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7)
    a = default_engine.generate(prompt, params, spec=LOOKUP)
    b = default_engine.generate(prompt, params, spec=LOOKUP)
    assert a.tokens == b.tokens and len(a.tokens) > 0


def test_cli_generate_json_on_the_default_model(default_engine):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-m", "codespec", "generate", "--chat", "--json", "--max-tokens", "24",
                           "--dtype", "float32", "Write a Python function that reverses a string."],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["text"].strip() and data["stats"]["generated_tokens"] == len(data["tokens"]) <= 24
    assert [d["name"] for d in data["stats"]["drafters"]] == ["ngram-mod", "prompt-lookup"]  # the default chain


def test_local_gguf_is_converted_once_and_loads(tmp_path, monkeypatch, default_engine):
    """`--model FILE.gguf`: converted into $CODESPEC_HOME on first use, then loaded like a checkpoint."""
    from codespec.config import ModelConfig
    from codespec.engine import Engine
    from codespec.forward.models import locate_default_gguf

    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path))
    gguf = locate_default_gguf()
    converted = pull(str(gguf), show_progress=False)
    assert converted.parent == tmp_path / "models" and (converted / "model.safetensors").is_file()
    assert pull(str(gguf), show_progress=False) == converted  # the second time is a lookup
    engine = Engine.load(ModelConfig(model=str(gguf), dtype="float32"), show_progress=False)
    prompt = engine.encode("def add(a, b):\n")
    params = SamplingParams(max_tokens=16)
    assert engine.generate(prompt, params).tokens == default_engine.generate(prompt, params).tokens


def test_shared_pool_across_sessions_on_the_default_model(default_engine):
    """Session A rewrites a function, then session B asks the same: B drafts from what A wrote, the
    output stays plain greedy's, and a chain with a derived draft model is lossless too."""
    engine = default_engine
    prompt = engine.encode(edit_prompt(), chat=True)
    params = SamplingParams(max_tokens=64)
    plain = engine.generate(prompt, params, spec=NONE)
    mod = SpecConfig(spec=("ngram-mod",))  # the engine's one pool (n = 24)
    engine.shared.pool.reset()
    cold = engine.generate(prompt, params, session_id="B-cold", spec=mod)
    engine.shared.pool.reset()
    engine.generate(prompt, params, session_id="A", spec=mod)
    warm = engine.generate(prompt, params, session_id="B", spec=mod)
    assert cold.tokens == warm.tokens == plain.tokens
    assert warm.stats.accepted_tokens > cold.stats.accepted_tokens + 30
    chain = SpecConfig(spec=("prompt-lookup", "ngram-mod", "draft"), draft_layers=6)
    result = engine.generate(prompt, params, session_id="C", spec=chain)
    assert result.tokens == plain.tokens
    assert [d.name for d in result.stats.drafters] == ["prompt-lookup", "ngram-mod", "draft"]


@pytest.mark.needs_kernels("q8 cache attention")
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_identity_with_a_q8_cache(default_engine, name):
    """--cache-type q8 (keys and values in 8 bits, scored against queries rounded alike): speculative greedy output
    equals plain greedy output, with drafts short and long."""
    text, chat = PROMPTS[name]
    prompt = default_engine.encode(text, chat=chat)
    params = SamplingParams(max_tokens=64)
    default_engine.path.use_cache_type("q8")
    try:
        assert default_engine.path.new_cache().keys.dtype == torch.int8
        plain = default_engine.generate(prompt, params, spec=NONE)
        assert len(plain.tokens) > 10
        for spec in (LOOKUP, LOOKUP_LONG):
            assert default_engine.generate(prompt, params, spec=spec).tokens == plain.tokens
    finally:
        default_engine.path.use_cache_type(ModelConfig.cache_type)


def test_a_batched_run_is_token_identical_to_each_request_alone(default_engine):
    """Four requests decoded together by the scheduler (one forward for all of their rows) in float32."""
    from codespec.scheduler import Scheduler

    params = SamplingParams(max_tokens=48)
    work = [(prompt, chat) for prompt, chat in PROMPTS.values()] + [("def fibonacci(n):", False)]
    alone = [default_engine.generate(prompt, params, chat=chat).tokens for prompt, chat in work]
    scheduler = Scheduler(default_engine)
    gate, inside = threading.Event(), threading.Event()
    threading.Thread(target=scheduler.call, args=(lambda engine: inside.set() or gate.wait(30),), daemon=True).start()
    try:
        inside.wait(30)  # the worker is held, so all four start in the same tick
        jobs = [scheduler.submit(prompt, params, chat=chat) for prompt, chat in work]
        gate.set()
        results = [job.wait() for job in jobs]
        assert [result.tokens for result in results] == alone
        # the jobs' forwards were shared: fewer forwards ran than the jobs made
        assert scheduler.batched_ticks > 0 and scheduler.ticks < sum(r.stats.target_forwards for r in results)
    finally:
        scheduler.close()


@pytest.fixture(scope="module")
def checkpoint_engine():
    """The default model on the converted checkpoint's weights (--weights checkpoint): bfloat16 values, read as
    16 bits by the numba path."""
    from codespec.config import ModelConfig
    from codespec.engine import Engine

    return Engine.load(ModelConfig(dtype="float32", weights="checkpoint"), show_progress=False)


def test_the_default_reads_the_gguf_blocks(default_engine):
    assert default_engine.gguf is not None
    assert default_engine.path.reads == ("gguf blocks, q8 activations" if q8_tiles.available() else "gguf blocks")
    assert isinstance(default_engine.path.kernel_weights.head, tuple)  # the Q8_0 output layer's blocks, not 16 bits


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_identity_on_the_checkpoint_weights(checkpoint_engine, name):
    assert checkpoint_engine.gguf is None and checkpoint_engine.path.reads == "16 bits"
    assert_greedy_identity(checkpoint_engine, name)


def test_cli_weights_gguf_and_its_one_line_errors(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    run = lambda *args: subprocess.run([sys.executable, "-m", "codespec", "generate", *args],  # noqa: E731
                                       capture_output=True, text=True, env=env, timeout=600)
    done = run("--weights", "gguf", "--json", "--max-tokens", "16", "def reverse(text):")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["generated_tokens"] == 16
    done = run("--weights", "checkpoint", "--json", "--max-tokens", "16", "def reverse(text):")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["generated_tokens"] == 16
    wrong = run("--weights", "gguf", "--model", str(tmp_path), "x")
    assert wrong.returncode != 0 and len(wrong.stderr.strip().splitlines()) == 1
    assert "holds no config.json" in wrong.stderr or "reads a GGUF file" in wrong.stderr
    wrong = run("--weights", "gguf", "--dtype", "bfloat16", "x")
    assert wrong.returncode != 0 and wrong.stderr.strip().splitlines() == [
        "codespec: error: --weights gguf runs on CPUs in float32 (--device cpu --dtype float32), with numba's "
        "OpenMP pool (the system's libgomp)"]


def test_the_default_models_tokenizer_is_read_without_transformers_and_answers_as_transformers_does(tmp_path):
    """A load reads the tokenizer saved on the first load with the `tokenizers` library alone (SavedTokenizer, in
    the first load too, so that every load tokenizes alike), answering as transformers' tokenizer of the GGUF's own
    metadata does, on code, prose and the chat template."""
    from transformers import AutoTokenizer

    from codespec.forward import gguf_model
    from codespec.forward.models import locate_default_gguf
    from codespec.forward.tokenizer import SavedTokenizer
    from tests.unit.test_tokenizer import CHATS, TEXTS, compare

    path = locate_default_gguf()
    _, first = gguf_model.metadata(path, tmp_path / "meta")
    _, again = gguf_model.metadata(path, tmp_path / "meta")
    assert isinstance(first, SavedTokenizer) and isinstance(again, SavedTokenizer)
    from_file = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = TEXTS + [inspect.getsource(textwrap)] + [prompt for prompt, _ in PROMPTS.values()]
    chats = CHATS + [[{"role": "user", "content": edit_prompt()}]]
    compare(again, from_file, texts, chats)
