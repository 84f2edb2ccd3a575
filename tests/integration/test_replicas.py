"""`codespec serve --replicas 2` for real: a local Ray, Serve's HTTP proxy on loopback, two CPU replicas of the tiny
test model behind the gateway (codespec/replicas). Sessions stay on their replica, unnamed prompts follow their
prefix, and a replica killed mid-run loses only caches: the requests it held are answered elsewhere or end with a
clear error, and its sessions are rebuilt on the next request."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serving import free_port

SOURCE = Path(textwrap.__file__).read_text()
SESSIONS = ["doc-a", "doc-b", "doc-c", "doc-d"]


def body(session: str | None, n_predict: int = 12, **more) -> dict:
    """An /infill request whose prefix (about 200 tiny-model tokens) is the session's own part of a real file."""
    start = 2000 + 700 * (SESSIONS.index(session) if session in SESSIONS else 5)
    request = {"input_prefix": SOURCE[start:start + 600], "prompt": "    return ", "input_suffix": "",
               "n_predict": n_predict, **more}
    if session is not None:
        request["session"] = session
    return request


def replicas(client) -> dict[str, int]:
    """Live replica id -> its process id."""
    return {row["replica"]: row["pid"] for row in client.get("/replicas").json()}


def wait_for_replicas(client, process, count: int, seconds: float) -> dict[str, int]:
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, f"codespec serve --replicas exited with {process.returncode}"
        try:
            live = replicas(client)
            if len(live) == count:
                return live
        except (httpx.TransportError, ValueError):
            pass
        assert time.monotonic() < deadline, f"{count} replicas did not come up in {seconds} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def service(tiny_dir):
    port = free_port()
    env = {**os.environ, "CODESPEC_API_KEY": "", "RAY_ADDRESS": ""}
    process = subprocess.Popen([sys.executable, "-m", "codespec", "serve", "--replicas", "2", "--replica-cpus", "1",
                                "--model", str(tiny_dir), "--port", str(port)], env=env, stderr=subprocess.PIPE,
                               text=True)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        wait_for_replicas(client, process, 2, 300)
        yield client, process
    finally:
        client.close()
        process.send_signal(signal.SIGTERM)  # stops Serve and the local Ray it started
        try:
            code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        assert code == 0, process.stderr.read()[-3000:]


def test_sessions_stay_on_their_replica_across_20_requests(service):
    client, _ = service
    served: dict[str, list[tuple[str, int]]] = {session: [] for session in SESSIONS}

    def editor(session):  # one client per session, five requests each, all four at once
        for _ in range(5):
            response = client.post("/infill", json=body(session))
            assert response.status_code == 200, response.text
            served[session].append((response.headers["x-codespec-replica"], response.json()["tokens_cached"]))

    threads = [threading.Thread(target=editor, args=(session,)) for session in SESSIONS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(len(rows) for rows in served.values()) == 20
    for session, rows in served.items():
        assert len({replica for replica, _ in rows}) == 1, (session, rows)  # affinity: 5 of 5 on one replica
        assert rows[0][1] == 0 and all(cached > 0 for _, cached in rows[1:]), (session, rows)  # its cache reused
    holders = {row["session"]: row["replica"] for row in client.get("/slots").json()}
    assert {session: holders[session] for session in SESSIONS} == {s: rows[0][0] for s, rows in served.items()}

    metrics = client.get("/metrics").text
    live = replicas(client)
    for replica in live:  # each replica's own metrics, labelled with its id
        assert f'codespec_queue_depth{{replica="{replica}"}}' in metrics
        assert f'codespec_active_generations{{replica="{replica}"}}' in metrics
        assert f'codespec_session_cache_bytes{{replica="{replica}"}}' in metrics
    assert 'codespec_draft_acceptance_ratio{drafter="ngram-mod",replica="' in metrics
    routed = [line for line in metrics.splitlines() if line.startswith('codespec_replica_routes_total{reason="session"}')]
    assert routed and float(routed[0].split()[-1]) >= 20


def test_header_session_and_unnamed_prompt_affinity(service):
    client, _ = service
    by_header = [client.post("/infill", json=body(None), headers={"X-Session-Id": "team-7"}) for _ in range(3)]
    assert len({r.headers["x-codespec-replica"] for r in by_header}) == 1
    unnamed = body(None)
    unnamed["input_prefix"] = SOURCE[9000:9600]  # a prompt no session has sent
    first = client.post("/infill", json=unnamed)
    again = client.post("/infill", json={**unnamed, "prompt": "    return x"})  # the same file, typed further
    assert first.status_code == again.status_code == 200
    assert again.headers["x-codespec-replica"] == first.headers["x-codespec-replica"]  # where its prefix is
    assert again.json()["tokens_cached"] > 0  # and the replica's slot had it


def test_a_killed_replica_loses_only_caches(service):
    client, process = service
    live = replicas(client)
    home = {s: client.post("/infill", json=body(s, n_predict=1)).headers["x-codespec-replica"] for s in SESSIONS}
    victim = home["doc-a"]
    lost = [s for s in SESSIONS if home[s] == victim]
    answers: dict[int, httpx.Response] = {}

    def in_flight(index):
        answers[index] = client.post("/infill", json=body("doc-a", n_predict=200))

    workers = [threading.Thread(target=in_flight, args=(i,)) for i in range(2)]
    with client.stream("POST", "/infill", json=body("doc-a", n_predict=200, stream=True)) as stream:
        assert stream.headers["x-codespec-replica"] == victim
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # generating
        for worker in workers:
            worker.start()
        time.sleep(0.2)
        os.kill(live[victim], signal.SIGKILL)  # the replica's process dies mid-run
        events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    for worker in workers:
        worker.join()

    last = events[-1] if events else None
    assert last is not None and (last.get("stop") is True or last["error"]["code"] == 503), events[-3:]
    for answer in answers.values():  # requests it had not answered: sent again to the other replica, or a clear error
        assert answer.status_code in (200, 503), answer.text
        if answer.status_code == 503:
            assert answer.json()["error"]["type"] == "server_error"
    assert [a.status_code for a in answers.values()].count(200) >= 1

    for session in SESSIONS:  # the service keeps answering every session; the victim's are rebuilt elsewhere
        response = client.post("/infill", json=body(session))
        assert response.status_code == 200, response.text
        if session in lost:
            assert response.headers["x-codespec-replica"] != victim
    for session in lost:  # and recovered: the next request reuses the rebuilt cache where it now lives (unless
        # Serve's replacement came up in between and took the session over: then the one after that)
        served = []
        for _ in range(3):
            response = client.post("/infill", json=body(session))
            assert response.status_code == 200, response.text
            served.append((response.headers["x-codespec-replica"], response.json()["tokens_cached"]))
            if len(served) > 1 and served[-1][0] == served[-2][0]:
                break
        assert served[-1][0] == served[-2][0] and served[-1][1] > 0, served

    after = wait_for_replicas(client, process, 2, 120)  # Serve replaced the dead replica
    assert victim not in after
