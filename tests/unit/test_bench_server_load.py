"""codespec.bench.server_load's throughput phase on the tiny model's real app (a live uvicorn, `--url`): each
concurrent run's completions against the one-client run's, `identical_outputs` in the report and the table, and
`--require-identity`'s exit status. The same run against a real `codespec serve` on the default model:
tests/integration/test_bench_server_load.py."""

import json

from codespec.bench import server_load
from tests.serving import tiny_client

ARGS = ["--phases", "throughput", "--clients", "1,2", "--rounds", "2", "--n-predict", "6", "--requests", "2",
        "--prefix-lines", "12"]


def run(engine, tmp_path, *extra) -> tuple[int, dict]:
    out = tmp_path / "server-load.json"
    with tiny_client(engine) as client:
        code = server_load.main(["--url", str(client.base_url), "--out", str(out), *ARGS, *extra])
    return code, json.loads(out.read_text())


def test_concurrent_completions_are_compared_with_the_one_client_runs(engine, tmp_path, monkeypatch, capsys):
    answered, ask = [], server_load.infill

    def spy(client, body):
        result = ask(client, body)
        if body["n_predict"] == 6 and "session" in body:  # a session's round, as the server answered it
            answered.append((body["session"], result["content"]))
        return result

    monkeypatch.setattr(server_load, "infill", spy)
    code, report = run(engine, tmp_path, "--require-identity")
    assert code == 0
    recorded = [(name, text) for mode in ("one_client", "concurrent_1", "concurrent_2")
                for name, texts in report[mode]["outputs"].items() for text in texts]
    assert sorted(recorded) == sorted(answered) and len(answered) == 4 + 2 + 4  # each completion, whole
    alone = report["one_client"]["outputs"]
    assert sorted(alone) == ["client-0", "client-1"] and all(len(rounds) == 2 for rounds in alone.values())
    assert all(isinstance(text, str) for rounds in alone.values() for text in rounds)
    assert any(text for rounds in alone.values() for text in rounds)  # tokens were generated
    assert report["concurrent_1"]["outputs"] == {"client-0": alone["client-0"]}
    assert report["concurrent_2"]["outputs"] == alone
    assert report["concurrent_1"]["identical_outputs"] == {"identical": 2, "total": 2, "differing_sessions": []}
    assert report["concurrent_2"]["identical_outputs"] == {"identical": 4, "total": 4, "differing_sessions": []}
    assert "identical_outputs" not in report["one_client"]
    table = capsys.readouterr().err.split("identical outputs\n")[1].splitlines()
    assert table[0].split()[0] == "1" and table[0].split()[-1] == "2/2"
    assert table[1].split()[0] == "2" and table[1].split()[-1] == "4/4"


def test_a_differing_completion_is_counted_and_fails_require_identity(engine, tmp_path, monkeypatch, capsys):
    measured = server_load.throughput

    def one_completion_changed(client, bodies, n_predict, clients, rounds, concurrent):
        result = measured(client, bodies, n_predict, clients, rounds, concurrent)
        if concurrent and clients == 2:
            result["outputs"]["client-1"][1] += " changed"
        return result

    monkeypatch.setattr(server_load, "throughput", one_completion_changed)
    code, report = run(engine, tmp_path)
    assert code == 0  # reported, not enforced
    assert report["concurrent_2"]["identical_outputs"] == {"identical": 3, "total": 4,
                                                          "differing_sessions": ["client-1"]}
    assert report["concurrent_1"]["identical_outputs"]["differing_sessions"] == []
    err = capsys.readouterr().err
    assert "3/4" in err and "2 clients: client-1" in err
    code, report = run(engine, tmp_path, "--require-identity")
    assert code == 1


def test_serve_arguments_after_the_double_dash_reach_every_server(monkeypatch, tmp_path):
    started = []

    class Stop(Exception):
        pass

    def popen(command, *args, **kwargs):
        started.append(command)
        raise Stop

    monkeypatch.setattr(server_load.subprocess, "Popen", popen)
    try:
        server_load.main(["--phases", "throughput", "--out", str(tmp_path / "r.json"), "--",
                          "--device", "cuda", "--dtype", "bfloat16"])
    except Stop:
        pass
    assert started and started[0][-4:] == ["--device", "cuda", "--dtype", "bfloat16"]
    assert started[0][1:4] == ["-m", "codespec", "serve"]
