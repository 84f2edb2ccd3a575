"""codespec.bench.server_load as a user runs it, on the default model: three real `codespec serve` processes (the
one-client run, one client and two at once), each concurrent run's completions identical to the one-client run's
(`--require-identity`), and the serve arguments after `--` reaching them (`--dtype float32`)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_two_concurrent_sessions_complete_as_one_client_alone_does(tmp_path):
    out = tmp_path / "server-load.json"
    finished = subprocess.run([sys.executable, "-m", "codespec.bench.server_load", "--phases", "throughput",
                               "--clients", "1,2", "--rounds", "2", "--n-predict", "8", "--requests", "2",
                               "--require-identity", "--out", str(out), "--", "--dtype", "float32"],
                              capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["serve_args"] == ["--dtype", "float32"]
    alone = report["one_client"]["outputs"]
    assert sorted(alone) == ["client-0", "client-1"] and all(len(rounds) == 2 for rounds in alone.values())
    assert report["one_client"]["tokens"] > 0 and any(text.strip() for rounds in alone.values() for text in rounds)
    assert report["concurrent_1"]["identical_outputs"] == {"identical": 2, "total": 2, "differing_sessions": []}
    assert report["concurrent_2"]["identical_outputs"] == {"identical": 4, "total": 4, "differing_sessions": []}
    assert report["concurrent_2"]["outputs"] == alone
    table = finished.stderr.split("identical outputs\n")[1].splitlines()
    assert [line.split()[-1] for line in table[:2]] == ["2/2", "4/4"]
