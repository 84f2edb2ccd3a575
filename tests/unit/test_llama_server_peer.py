"""The llama-server peer of `codespec bench` without llama-server: its flags, its answer parsing, a missing binary
as a one-line error, and the whole bench path against a fake llama-server (a few lines of Python)."""

import json
import stat
import sys
import textwrap

import pytest

from codespec.bench import llama_server, runner
from codespec.bench.workloads import Workload
from codespec.cli import main
from codespec.config import SpecConfig
from codespec.engine import Engine
from codespec.errors import CodespecError
from tests.tiny import EOS, tiny_model

ANSWER = {  # trimmed from a real llama-server /completion answer (return_tokens true, n-gram speculation on)
    "index": 0, "content": "def f(x):\n    return x", "tokens": [1489, 281, 46, 106, 731], "id_slot": 0, "stop": True,
    "tokens_predicted": 5, "tokens_evaluated": 412, "stop_type": "limit", "truncated": False, "tokens_cached": 416,
    "timings": {"cache_n": 0, "prompt_n": 412, "prompt_ms": 301.5, "prompt_per_token_ms": 0.73,
                "prompt_per_second": 1366.5, "predicted_n": 5, "predicted_ms": 40.0, "predicted_per_token_ms": 8.0,
                "predicted_per_second": 125.0, "draft_n": 12, "draft_n_accepted": 3},
}


def test_settings_are_plain_then_defaults_then_draft_max_16():
    names = [s.name for s in llama_server.settings()]
    assert names == ["llama-server plain", "llama-server ngram-simple", "llama-server ngram-mod",
                     "llama-server ngram-simple draft-max 16", "llama-server ngram-mod draft-max 16"]
    args = {s.name: s.args for s in llama_server.settings(["ngram-mod", "ngram-map-k4v", "ngram-cache"])}
    assert args["llama-server plain"] == []
    assert args["llama-server ngram-mod"] == ["--spec-type", "ngram-mod"]
    assert args["llama-server ngram-mod draft-max 16"] == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "16",
                                                           "--spec-ngram-mod-n-min", "16"]
    assert args["llama-server ngram-map-k4v draft-max 16"][-2:] == ["--spec-ngram-map-k4v-size-m", "16"]
    assert "llama-server ngram-cache draft-max 16" not in args  # ngram-cache has no draft-length flag
    assert not llama_server.settings()[0].stateful and all(s.stateful for s in llama_server.settings()[1:])
    with pytest.raises(CodespecError, match="unknown llama-server spec type"):
        llama_server.settings(["ngram-simple", "eagle"])


def test_server_command_and_request():
    command = llama_server.server_command("/bin/llama-server", "/m.gguf", 8080, 2, ["--spec-type", "ngram-mod"])
    joined = " ".join(command)
    assert command[:3] == ["/bin/llama-server", "-m", "/m.gguf"]
    for flag in ("--port 8080", "-t 2", "-tb 2", "-np 1", "--cache-ram 0", "-c 8192", "--host 127.0.0.1"):
        assert flag in joined
    assert command[-2:] == ["--spec-type", "ngram-mod"]
    body = llama_server.completion_request([1, 2, 3], 256, cache_prompt=False)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 256 and body["temperature"] == 0
    assert body["top_k"] == 1 and body["cache_prompt"] is False and body["return_tokens"] is True
    json.dumps(body)


def test_parse_completion_and_its_timings():
    done = llama_server.parse_completion(json.loads(json.dumps(ANSWER)))
    assert done.tokens == [1489, 281, 46, 106, 731] and done.content.startswith("def f")
    assert (done.prompt_n, done.prompt_ms, done.predicted_n, done.predicted_ms) == (412, 301.5, 5, 40.0)
    assert (done.draft_n, done.draft_n_accepted) == (12, 3)
    plain = dict(ANSWER, timings={k: v for k, v in ANSWER["timings"].items() if not k.startswith("draft")})
    assert llama_server.parse_completion(plain).draft_n == 0  # no draft_n without speculation
    with pytest.raises(CodespecError, match="no 'tokens'"):
        llama_server.parse_completion({"content": "x"})


@pytest.mark.parametrize("make, message", [(lambda p: p / "nothing-here", "not found"),
                                           (lambda p: p.joinpath("llama-server").write_text("") or
                                            p / "llama-server", "not executable")])
def test_missing_binary_is_a_one_line_cli_error(capsys, tmp_path, make, message):
    code = main(["bench", "--quick", "--llama-server", str(make(tmp_path)), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and message in err and "build_llama_server" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


FAKE = """\
#!{python}
# A fake llama-server: /health, and /completion answering a fixed function of the prompt with llama's timings;
# its speculative settings answer the same text, except the ngram-simple draft-max one (its last token differs)
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
spec = "--spec-type" in args
differ = "--spec-ngram-simple-size-m" in args
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self.reply({{"status": "ok"}})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["temperature"] == 0 and req["return_tokens"] and isinstance(req["prompt"], list)
        tokens = [(sum(req["prompt"]) + i) % 300 + 3 for i in range(req["n_predict"])]
        if differ:
            tokens[-1] += 1
        t = {{"prompt_n": len(req["prompt"]), "prompt_ms": 2.0, "predicted_n": len(tokens), "predicted_ms": 4.0}}
        if spec:
            t.update(draft_n=8, draft_n_accepted=4)
        self.reply({{"content": "x", "tokens": tokens, "timings": t}})
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_bench_rows_from_a_fake_llama_server(tokenizer, tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE.format(python=sys.executable))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    engine = Engine(tiny_model(context=1024), tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}))
    workloads = [Workload("edit:x", "edit", (textwrap.dedent(llama_server.__doc__[:300]),)),
                 Workload("multi-turn:x", "multi-turn", ("rename x to y", "now add a docstring"))]
    configs = runner.build_configs(quick=True, draft_max=8, default_spec=SpecConfig(draft_max=8), layers=2)[:2]
    with llama_server.Peer(binary, gguf, threads=2) as peer:
        configs += [runner.Config(name, server=server) for name, server in peer.servers.items()]
        rows = runner.run_bench(engine, workloads, configs, repeats=2, max_tokens=6, turns=2)
        described = peer.describe()
    assert all(s.process is None for s in peer.servers.values())  # every fake server stopped
    assert described["threads"] == 2 and described["settings"]["llama-server plain"] == []
    data = runner.report(rows, {"device": "cpu", "dtype": "float64", "max_tokens": 6, "repeats": 2,
                                "llama_server": described})
    peer_rows = {(r["workload"], r["config"]): r for r in data["results"] if runner.is_peer(r["config"])}
    assert len(peer_rows) == 2 * 5
    multi = peer_rows[("multi-turn:x", "llama-server plain")]
    assert multi["tokens"] == 12 and multi["tokens_per_second_vs_llama_server_plain"] == 1.0
    assert multi["server_predicted_per_second"] == 1500.0  # 12 tokens over 2 x 4 ms, llama-server's own clock
    assert multi["drafted"] == 0 and peer_rows[("multi-turn:x", "llama-server ngram-mod")]["drafted"] == 16
    assert peer_rows[("edit:x", "llama-server ngram-mod")]["acceptance"] == 0.5
    same = {config: r["identical_to_plain"] for (workload, config), r in peer_rows.items() if workload == "edit:x"}
    assert same == {"llama-server plain": True, "llama-server ngram-simple": True, "llama-server ngram-mod": True,
                    "llama-server ngram-simple draft-max 16": False, "llama-server ngram-mod draft-max 16": True}
    codespec_plain = [r for r in data["results"] if r["config"] == runner.PLAIN][0]
    assert codespec_plain["tokens_per_second_vs_llama_server_plain"] > 0 and codespec_plain["identical_to_plain"]
    assert not any(runner.is_peer(s) for s in data["slower_than_plain"])
    assert all("median_tokens_per_second" in s for s in data["by_class"])
    table = runner.format_table(data)
    assert "llama-server ngram-mod draft-max 16" in table and "vs llama" in table and "pred t/s" in table


def test_the_report_names_the_instruction_sets_llama_server_was_built_for(tmp_path):
    """`build_llama_server --cpu avx2` leaves GGML_NATIVE=OFF, AVX2=ON, AVX512=OFF in its build's CMakeCache.txt: the
    side-by-side report reads them there (the binary's own log lists them only at trace verbosity)."""
    from codespec.bench.build_llama_server import AVX2_FLAGS

    binary = tmp_path / "build-avx2" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    cache = "".join(f"GGML_{flag[len('-DGGML_'):].split('=')[0]}:BOOL={flag.split('=')[1]}\n" for flag in AVX2_FLAGS)
    (tmp_path / "build-avx2" / "CMakeCache.txt").write_text("CMAKE_BUILD_TYPE:STRING=Release\n" + cache)
    assert llama_server.cpu_features(binary) == ("NATIVE=OFF, AVX=ON, AVX2=ON, FMA=ON, F16C=ON, AVX_VNNI=OFF, "
                                                 "AVX512=OFF, AVX512_VNNI=OFF, AVX512_BF16=OFF")
    assert llama_server.cpu_features(tmp_path / "elsewhere" / "llama-server") == "unknown"
