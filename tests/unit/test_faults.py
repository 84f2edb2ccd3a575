"""Faults a user can run into: a damaged converted-model cache, a full disk or a kill during conversion, a damaged
cost cache. Each ends as working output or one line that names the file and the fix, never an internal error.

The GGUF conversion runs for real on the tiny model: only reading the GGUF file is faked (it hands back the tiny
model and tokenizer), so saving, staging, renaming and loading are the code users run."""

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
import transformers
from safetensors import SafetensorError

from codespec.adaptive import SIZES, cached_costs, choose
from codespec.cli import main
from codespec.config import SamplingParams, ServerConfig, SpecConfig
from codespec.engine import Engine
from codespec.forward import forward_path
from codespec.server import create_app
from tests.serving import live_server
from tests.tiny import EOS, tiny_model, tiny_tokenizer
from tests.gguf_files import write_gguf


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A .gguf file whose "conversion" yields the tiny model, with $CODESPEC_HOME in tmp_path: its path as `file`,
    and `conversions`, which grows by one each time it is read."""
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path / "home"))
    gguf = write_gguf(tmp_path / "tiny.gguf", tiny_model(dtype=torch.float32), permute=True)  # (its header is read)
    conversions = []
    load_model, load_tokenizer = transformers.AutoModelForCausalLM.from_pretrained, \
        transformers.AutoTokenizer.from_pretrained

    def model_from(location, *args, gguf_file=None, **kwargs):
        if gguf_file is None:
            return load_model(location, *args, **kwargs)
        conversions.append(gguf_file)
        return tiny_model(dtype=torch.float32)

    def tokenizer_from(location, *args, gguf_file=None, **kwargs):
        return tiny_tokenizer() if gguf_file else load_tokenizer(location, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_from)
    return SimpleNamespace(file=str(gguf), conversions=conversions)


def run(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.err


def models(tmp_path):
    return sorted(p.name for p in (tmp_path / "home" / "models").iterdir() if p.name != ".pull.lock")


def truncate(file):
    file.write_bytes(file.read_bytes()[:1000])


def garbage(file):
    file.write_bytes(b"\x7f" * 100)


@pytest.mark.parametrize("damage, file", [
    (truncate, "model.safetensors"),  # a copy or conversion cut short: was "internal error: SafetensorError"
    (garbage, "model.safetensors"),
    (lambda f: f.unlink(), "model.safetensors"),
    (lambda f: f.write_text('{"model_type": "lla'), "config.json"),
])
def test_a_damaged_converted_model_is_converted_again(fake_gguf, tmp_path, capsys, damage, file):
    assert run(capsys, "pull", "--model", fake_gguf.file)[0] == 0
    (converted,) = (tmp_path / "home" / "models").glob("tiny-*")
    damage(converted / file)
    code, err = run(capsys, "generate", "--model", fake_gguf.file, "--weights", "checkpoint", "--max-tokens", "4",
                    "def f(")  # (the converted model: what --weights checkpoint runs; auto reads the file directly)
    assert code == 0, err
    assert f"the converted model is damaged: {converted / file}" in err and "converting it again" in err
    assert len(fake_gguf.conversions) == 2
    assert models(tmp_path) == [converted.name]  # no staging folder, no old copy left beside it


def test_a_gguf_whose_metadata_does_not_match_its_tensors_is_one_line(fake_gguf, capsys):
    """The fake file carries no model metadata, so transformers' config from it is Llama's default shape (hidden
    4096), which its tensors are not: read directly, that is a one-line error naming the file, not a traceback."""
    code, err = run(capsys, "generate", "--model", fake_gguf.file, "--max-tokens", "4", "def f(")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("codespec: error: tiny.gguf's metadata does not match its tensors: blk.0.attn_norm.weight has 64 values")


def test_a_conversion_that_would_not_fit_in_memory_is_refused_before_it_starts(fake_gguf, capsys, monkeypatch):
    """The kernel would kill the process part way through (a 1.7B Q4_K_M took 24 GB): one line instead, from the
    file's header, before transformers reads a weight. The machine's free memory is the one thing made up here."""
    from codespec.forward import models

    needed = models.conversion_memory(Path(fake_gguf.file))
    assert 0 < needed < 1 << 30  # the tiny model's weights as float32, times CONVERSION_MEMORY
    monkeypatch.setattr(models, "available_memory", lambda: needed - 1)
    code, err = run(capsys, "pull", "--model", fake_gguf.file)
    assert code == 1 and "takes about" in err and "MB is available" in err and len(err.strip().splitlines()) == 1
    assert fake_gguf.conversions == []
    monkeypatch.setattr(models, "available_memory", lambda: needed)
    assert run(capsys, "pull", "--model", fake_gguf.file)[0] == 0 and len(fake_gguf.conversions) == 1


def test_a_truncated_gguf_is_one_line_before_anything_heavy(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path / "home"))
    gguf = write_gguf(tmp_path / "cut.gguf", tiny_model(dtype=torch.float32), permute=True)
    truncate(gguf)
    code, err = run(capsys, "pull", "--model", str(gguf))
    assert code == 1 and err.startswith("codespec: error: cannot read GGUF") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),  # what it raises
])
def test_disk_full_during_conversion_leaves_nothing_behind(fake_gguf, tmp_path, capsys, monkeypatch, error):
    save = transformers.PreTrainedModel.save_pretrained

    def fill_the_disk(model, folder, **kwargs):
        (folder / "model.safetensors").write_bytes(b"\0" * 1000)  # half written when the disk fills up
        raise error

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", fill_the_disk)
    code, err = run(capsys, "pull", "--model", fake_gguf.file)
    last = err.strip().splitlines()[-1]  # after pull's progress bar
    assert code == 1 and "Traceback" not in err, err
    assert last.startswith("codespec: error: disk full while saving the converted model into"), err
    assert "CODESPEC_HOME" in last
    assert models(tmp_path) == []

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save)  # space freed: the next pull works
    assert run(capsys, "pull", "--model", fake_gguf.file)[0] == 0
    assert len(models(tmp_path)) == 1


def test_staging_left_by_a_killed_conversion_goes_at_the_next_pull_but_not_while_one_runs(fake_gguf, tmp_path,
                                                                                         capsys):
    folder = tmp_path / "home" / "models"
    stale = folder / ".pull-k1ll3d"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    with open(folder / ".pull.lock", "a") as lock:  # another process is converting, and that is its folder
        fcntl.flock(lock, fcntl.LOCK_EX)
        pulling = threading.Thread(target=run, args=(capsys, "pull", "--model", fake_gguf.file))
        pulling.start()
        pulling.join(timeout=0.5)
        assert pulling.is_alive() and stale.is_dir()  # waits for that conversion instead of deleting its folder
    pulling.join(timeout=60)  # the lock is free: its holder is gone, so the folder is stale now
    assert not pulling.is_alive()
    assert not stale.exists() and len(models(tmp_path)) == 1

    stale.mkdir()  # a later kill, with the model already converted: the next pull still cleans up
    assert run(capsys, "pull", "--model", fake_gguf.file)[0] == 0
    assert not stale.exists() and len(fake_gguf.conversions) == 1


def test_a_damaged_model_folder_is_one_line_naming_the_file(tiny_dir, tmp_path, capsys):
    folder = shutil.copytree(tiny_dir, tmp_path / "model")
    truncate(folder / "model.safetensors")
    code, err = run(capsys, "generate", "--model", str(folder), "x")
    assert code == 1 and len(err.strip().splitlines()) == 1, err  # was exit 70, "internal error: SafetensorError"
    assert f"{folder / 'model.safetensors'} is truncated or corrupted" in err


BAD_COST_FILES = [
    "{",  # cut short by a kill
    "[]",
    "null",
    '{"sizes": 5, "seconds": 1}',
    '{"sizes": [1], "seconds": [0.01]}',  # another version's sizes: cost(n > 1) failed with IndexError
    json.dumps({"sizes": list(SIZES), "seconds": [0.01] * (len(SIZES) - 1)}),
    json.dumps({"sizes": list(SIZES), "seconds": ["fast"] * len(SIZES)}),
    json.dumps({"sizes": list(SIZES), "seconds": [0.0] * len(SIZES)}),  # choose() divided by zero
    json.dumps({"sizes": list(SIZES), "seconds": [-0.01] * len(SIZES)}),
]


def named_tiny_model():
    """A tiny model with a name, so its costs are cached on disk like a real model's."""
    model = tiny_model()
    model.config._name_or_path = "tiny-faults"
    return model


def cost_file(tmp_path):
    (file,) = (tmp_path / "costs").glob("*.json")
    return file


@pytest.mark.parametrize("content", BAD_COST_FILES)
def test_a_damaged_cost_file_is_measured_again(tmp_path, monkeypatch, content):
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path))
    model = named_tiny_model()
    path = forward_path(model)
    cached_costs(path, model, model.config.vocab_size)
    cost_file(tmp_path).write_text(content)
    costs = cached_costs(path, model, model.config.vocab_size)
    assert costs.sizes == SIZES and all(seconds > 0 for seconds in costs.seconds)
    assert [costs.cost(n) for n in (1, 3, 200)] == sorted(costs.cost(n) for n in (1, 3, 200))
    choose(costs, 0.5, available=16, pending=1)
    assert json.loads(cost_file(tmp_path).read_text())["seconds"] == list(costs.seconds)  # written again


def test_a_damaged_cost_file_never_fails_a_request(tmp_path, monkeypatch):
    monkeypatch.setenv("CODESPEC_HOME", str(tmp_path))
    monkeypatch.delenv("CODESPEC_COSTS", raising=False)  # the integration tests pin a table for every engine
    model = named_tiny_model()
    Engine(model, tiny_tokenizer(), eos_token_ids=frozenset({EOS})).costs  # noqa: B018 (measured and cached)
    cost_file(tmp_path).write_text(BAD_COST_FILES[4])
    engine = Engine(model, tiny_tokenizer(), eos_token_ids=frozenset({EOS}))
    prompt = "import os\nimport sys\n" * 3
    plain = engine.generate(prompt, SamplingParams(max_tokens=24), spec=SpecConfig(spec=("none",))).text
    with live_server(create_app(engine, ServerConfig())) as url:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 24}, timeout=60)
    assert response.status_code == 200, response.text  # was 500 on every greedy request
    assert response.json()["choices"][0]["text"] == plain


def printed_number(script: str, **env) -> int:
    """What a fresh Python process running `script` (with `env` added to the environment) prints: one number."""
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


FREED_BUFFERS = """
import numpy as np
from codespec.cli.memory import return_freed_memory
return_freed_memory()
np.ones(1 << 20)  # 8 MB, mmapped and freed: glibc's dynamic threshold rises past the 3 MB buffers below
buffers = [np.ones(3 << 17) for _ in range(64)]  # 64 x 3 MB, then all freed but the last
last = buffers[-1]
del buffers
print(int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20)
"""


def test_freed_buffers_go_back_to_the_system():
    """A server's per-request buffers of a few MB: with glibc's dynamic threshold the freed ones stay in the heap
    (RSS about 190 MB above the start here); with the fixed threshold they are unmapped."""
    kept, returned = printed_number(FREED_BUFFERS, CODESPEC_MMAP_THRESHOLD="0"), printed_number(FREED_BUFFERS)
    assert kept - returned > 150, (kept, returned)


REUSED_TOP = """
import resource
import numpy as np
from codespec.cli.memory import return_freed_memory
return_freed_memory()
np.ones(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):  # a prompt chunk's buffers: under the mmap threshold, from the top of the heap, then freed
    buffer = np.ones(900_000 // 8)
    del buffer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_buffers_under_the_threshold_keep_their_pages_between_uses():
    """With the mmap threshold fixed, glibc's trim threshold stayed at 128 KiB: every freed buffer of 128 KiB-1 MB
    at the top of a heap went back to the system and was faulted in again by the next (a prompt chunk's, ~2,400
    times a 3,539-token prefill). Now a heap keeps up to twice the mmap threshold at its top. The old setting, given
    to glibc by its own variable, is the baseline: 50 buffers of 900 KB cost ~9,400 page faults there, ~200 now."""
    trimmed, kept = printed_number(REUSED_TOP, MALLOC_TRIM_THRESHOLD_=str(128 << 10)), printed_number(REUSED_TOP)
    assert trimmed > 5_000 and kept < 1_000, (trimmed, kept)


MATMUL_SHAPES = """
import torch
from codespec.cli.memory import return_freed_memory
return_freed_memory()
torch.set_num_threads(1)
shapes = [(576, 960), (576, 3072), (1536, 576)]  # the default model's layer matmuls
weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(rows, cols)) for cols, rows in shapes]
for count in range(1, 121):  # the row counts batched forwards meet, each a new oneDNN primitive per shape
    for weight, (cols, _) in zip(weights, shapes):
        torch.ops.mkldnn._linear_pointwise(torch.randn(count, cols), weight, None, "none", [], "")
print(int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20)
"""


@pytest.mark.parametrize("variable, name", [("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "PRIMITIVE_CACHE"),
                                            ("LRU_CACHE_CAPACITY", "LRU_CACHE")])
def test_onednn_and_ideep_keep_few_matmuls_so_new_batch_shapes_do_not_grow_memory(variable, name):
    """Every new number of rows in a batched forward compiles a new oneDNN primitive per weight shape, and ideep (the
    layer above it) caches a computation per input shape, each kept up to 1,024 by default (RSS grew for as long as a
    soak met new shapes: 130 MB over these 360 matmuls for ideep's, 200 MB for oneDNN's); codespec keeps few."""
    environment = {key: value for key, value in os.environ.items() if key != variable}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", environment)
        import codespec.cli.memory as memory
        memory.return_freed_memory()
        assert environment[variable] == str(getattr(memory, name))
    default, bounded = printed_number(MATMUL_SHAPES, **{variable: "1024"}), printed_number(MATMUL_SHAPES)
    assert default - bounded > 60, (default, bounded)
