"""The CLI: bad input gives one line and a non-zero exit; good input gives text or JSON."""

import json
import os
import subprocess
import sys

import pytest

from codespec.cli import main
from codespec.errors import CodespecError


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    """These tests assert exact text: the CPU's (a GPU, found by --device auto, would round otherwise), also in
    the processes they start."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def run_cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("args, code, message", [
    (["--spec", "medusa", "x"], 2, "unknown spec"),
    (["--spec", "prompt-lookup,nope", "x"], 2, "unknown spec"),
    (["--draft-max", "0", "x"], 2, "outside 1..256"),
    (["--draft-max", "257", "x"], 2, "outside 1..256"),
    (["--draft-max", "many", "x"], 2, "not an integer"),
    (["--draft-min", "9", "--draft-max", "4", "x"], 1, "draft-min"),
    (["--top-p", "0", "x"], 1, "top-p"),
    (["--ctx-size", "-1", "x"], 1, "ctx-size"),
    (["--temperature", "-1", "x"], 1, "temperature"),
    (["   "], 1, "empty"),
    (["--model", "./no/such/dir", "x"], 1, "model path not found"),
    (["--model", "missing.gguf", "x"], 1, "model file not found"),
    (["--file", "/no/such/prompt.txt"], 1, "cannot read"),
])
def test_bad_input_is_one_line(capsys, args, code, message):
    with pytest.raises(SystemExit) if code == 2 else _noop() as raised:
        result = main(["generate", *args])
    captured = capsys.readouterr()
    actual = raised.value.code if code == 2 else result
    assert actual == code
    assert message in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err


class _noop:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_directory_without_config(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "x")
    assert code == 1 and "no config.json" in err


def test_unknown_device_and_dtype(capsys, tiny_dir):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--device", "tpu9", "x")
    assert code == 1 and "unknown device" in err
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--dtype", "float8", "x")
    assert code == 1 and "unknown dtype" in err


def test_prompt_longer_than_context(capsys, tiny_dir, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("def f(x):\n    return x\n" * 400)
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--file", str(prompt))
    assert code == 1 and "context is 512" in err


def test_json_output(capsys, tiny_dir):
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_dir), "--json", "--max-tokens", "12",
                           "--spec", "prompt-lookup", "--draft-max", "8", "def wrap(text):\n    return wrap(text)\n")
    assert code == 0
    data = json.loads(out)
    assert isinstance(data["text"], str) and len(data["tokens"]) <= 12
    for key in ("generated_tokens", "target_forwards", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                "tokens_per_forward", "seconds", "tokens_per_second", "forward_seconds", "overhead_share", "drafters"):
        assert key in data["stats"]
    assert data["stats"]["drafters"][0]["name"] == "prompt-lookup"
    assert data["stats"]["generated_tokens"] == len(data["tokens"])


def cli_process(*args, stdin=""):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run([sys.executable, "-m", "codespec", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=300)


def test_streaming_text_from_stdin_with_stats_on_stderr(tiny_dir):
    """A real process: text on stdout, one stats line per generation (+ one per drafter) on stderr."""
    plain = cli_process("generate", "--model", str(tiny_dir), "--max-tokens", "16", "--spec", "none",
                        stdin="def wrap(text, width):\n")
    fast = cli_process("generate", "--model", str(tiny_dir), "--max-tokens", "16", "--spec", "prompt-lookup",
                       stdin="def wrap(text, width):\n")
    assert plain.returncode == 0 and fast.returncode == 0, plain.stderr + fast.stderr
    assert plain.stdout == fast.stdout and plain.stdout.strip()
    assert "tok/s" in fast.stderr and "#acc tokens" in fast.stderr and "Traceback" not in fast.stderr


def test_hub_id_fails_cleanly_when_unreachable(tiny_dir):
    """No hub is reachable here (and this repository does not exist anywhere): one line, exit 1."""
    done = cli_process("generate", "--model", "codespec-tests/no-such-model", "x")
    assert done.returncode == 1
    assert done.stderr.strip().startswith("codespec: error:") and len(done.stderr.strip().splitlines()) == 1


def test_config_file_then_flags(tmp_path):
    from argparse import Namespace

    from codespec.cli.options import build_parser, settings_from_args
    from codespec.errors import CodespecError

    config = tmp_path / "codespec.toml"
    config.write_text('[spec]\nspec = ["prompt-lookup", "ngram-mod"]\ndraft-max = 8\nmod_n = 12\n'
                      '[sampling]\nmax_tokens = 5\ntemperature = 0.5\n[model]\ndtype = "float32"\n')
    args = build_parser().parse_args(["generate", "--config", str(config), "--mod-n", "6", "x"])
    model, spec, params = settings_from_args(args)
    assert spec.spec == ("prompt-lookup", "ngram-mod") and spec.draft_max == 8 and spec.mod_n == 6
    assert params.max_tokens == 5 and params.temperature == 0.5 and model.dtype == "float32"
    for bad, message in (('[spec]\ndraft-max = "x"\n', "wrong type"), ("[spec]\nwarp = 1\n", "unknown key"),
                         ("[turbo]\n", "unknown table"), ("[spec\n", "not valid TOML"),
                         ('[spec]\nspec = ["medusa"]\n', "unknown spec")):
        config.write_text(bad)
        with pytest.raises(CodespecError, match=message):
            settings_from_args(Namespace(config=str(config)))


def test_ngram_cache_build_then_generate_with_it(capsys, tiny_dir, tmp_path):
    import inspect
    import textwrap

    source = tmp_path / "corpus.py"
    source.write_text(inspect.getsource(textwrap))
    cache = tmp_path / "corpus.npz"
    code, _, err = run_cli(capsys, "ngram-cache", "build", str(source), "-o", str(cache), "--model", str(tiny_dir))
    assert code == 0 and cache.is_file() and "n-grams" in err
    args = ["generate", "--model", str(tiny_dir), "--json", "--max-tokens", "12", "def wrap(text, width=70):\n"]
    code, plain, _ = run_cli(capsys, *args, "--spec", "none")
    code2, cached, _ = run_cli(capsys, *args, "--spec", "ngram-cache", "--ngram-cache", str(cache))
    assert code == code2 == 0
    assert json.loads(plain)["tokens"] == json.loads(cached)["tokens"]
    assert json.loads(cached)["stats"]["drafters"][0]["name"] == "ngram-cache"
    code, _, err = run_cli(capsys, *args, "--spec", "ngram-cache", "--ngram-cache", str(source))
    assert code == 1 and "not a codespec n-gram cache" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "ngram-cache", "build", str(tmp_path / "missing.py"), "-o", str(cache),
                           "--model", str(tiny_dir))
    assert code == 1 and "cannot read" in err


def test_draft_model_with_another_vocabulary_is_refused(capsys, tiny_dir, tmp_path):
    from tests.tiny import save_tiny

    other = save_tiny(tmp_path / "other", vocab=320)
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--spec", "draft", "--draft-model",
                           str(other), "x")
    assert code == 1 and "vocabulary differs" in err
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--spec", "draft", "x")
    assert code == 1 and "--draft-model" in err


def test_a_setting_out_of_range_cannot_be_made():
    """The settings check themselves when made (and when dataclasses.replace makes one): config.InvalidSetting, a
    CodespecError (one line to the user, a 4xx from the server) that code checking for ValueError still catches, so
    no caller validates or wraps it."""
    from dataclasses import replace

    from codespec.config import InvalidSetting, ModelConfig, SamplingParams, ServerConfig, SpecConfig

    for make, message in ((lambda: SpecConfig(draft_max=0), "draft-max"), (lambda: SamplingParams(top_p=2.0), "top-p"),
                          (lambda: ModelConfig(context=-1), "ctx-size"), (lambda: ServerConfig(port=70000), "port"),
                          (lambda: replace(SpecConfig(), spec=("draft",)), "draft-model")):
        with pytest.raises(InvalidSetting, match=message) as raised:
            make()
        assert isinstance(raised.value, CodespecError) and isinstance(raised.value, ValueError)


@pytest.mark.parametrize("own_process", [False, True])
def test_lifelong_heap_freezes_only_the_commands_own_process(monkeypatch, own_process):
    """`codespec generate`, `serve` and `lsp` build their imports and engine with the cyclic collector off and then
    freeze them out of later passes; a caller's process (these tests) keeps its collector as it was. Either way the
    collector runs again after, also when the load fails."""
    import gc

    from codespec.cli import memory

    monkeypatch.setattr(memory, "OWN_PROCESS", own_process)
    frozen = gc.get_freeze_count()
    try:
        with pytest.raises(CodespecError), memory.lifelong_heap():
            assert gc.isenabled() is not own_process
            raise CodespecError("the load failed")
        assert gc.isenabled()
        assert (gc.get_freeze_count() > frozen) is own_process
    finally:
        gc.unfreeze()
        gc.enable()
