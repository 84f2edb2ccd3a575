"""The HTTP server on the tiny model: a real uvicorn on a loopback port, driven with httpx."""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from openapi_spec_validator import validate

from codespec.config import SamplingParams, ServerConfig
from codespec.server import create_app
from tests.conftest import random_prompt
from tests.serving import live_server, sse_events

PREFIX = "def total(values):\n    result = 0\n    for value in values:\n        "
SUFFIX = "\n    return result\n"


@pytest.fixture
def server(engine):
    app = create_app(engine, ServerConfig(slots=2, max_request_bytes=64 << 10))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        client.app = app
        yield client


def gate_worker(app):
    """Hold the engine's worker inside a call until the returned event is set."""
    gate, inside = threading.Event(), threading.Event()

    def hold(engine):
        inside.set()
        gate.wait(30)

    threading.Thread(target=app.state.scheduler.call, args=(hold,), daemon=True).start()
    inside.wait(10)
    return gate


def occupy(app):
    """Hold the engine's only active slot with a job that spins until the returned event is set; calls (which
    build prompts and submit jobs) still run between its turns."""
    gate = threading.Event()

    def spin(engine):
        while not gate.is_set():
            time.sleep(0.002)
            yield "turn"

    app.state.scheduler.submit_steps(spin)
    wait_until(lambda: app.state.scheduler.active == 1)
    return gate


def wait_until(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def metric(client, name: str) -> float:
    """The sum of a metric's samples, from /metrics."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_completion_matches_engine_and_stream_matches_non_stream(engine, server):
    prompt = "import os\nimport sys\n"
    expected = engine.generate(prompt, SamplingParams(max_tokens=24))
    body = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24}).json()
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.tokens)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + len(expected.tokens)
    with server.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected.text
    streamed_usage = events[-2]["usage"]
    assert {key: streamed_usage[key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {key: body["usage"][key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert events[-2]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_chat_stream_and_non_stream(server):
    request = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
               "max_tokens": 16}
    body = server.post("/v1/chat/completions", json=request).json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    with server.stream("POST", "/v1/chat/completions", json=request | {"stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == \
        body["choices"][0]["message"]["content"]
    assert events[-2]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]


def test_infill_fields_stream_and_speculation_overrides(engine, server):
    request = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 20, "spec": "prompt-lookup",
               "speculative.n_max": 4, "input_extra": [{"filename": "util.py", "text": "x = 1\n"}]}
    body = server.post("/infill", json=request).json()
    for key in ("content", "stop", "tokens_predicted", "tokens_cached", "truncated", "timings"):
        assert key in body
    assert set(body["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"}
    assert body["speculation"]["spec"] == ["prompt-lookup"]
    assert [d["name"] for d in body["speculation"]["drafters"]] == ["prompt-lookup"]
    with server.stream("POST", "/infill", json=request | {"stream": True}) as r:
        events = sse_events(r)
    assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == body["content"]


def test_llama_vim_requests(server):
    """What llama.vim sends, unchanged: a cache-warming request, then a completion with response_fields."""
    extra = [{"text": "def helper():\n    return 1\n", "time": 1, "filename": "a.py"}]
    warm = server.post("/infill", json={"input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
                                        "n_predict": 0, "temperature": 0.0, "stream": False, "samplers": [],
                                        "cache_prompt": True, "t_max_prompt_ms": 1, "t_max_predict_ms": 1,
                                        "response_fields": [""]})
    assert warm.status_code == 200 and warm.json() == {}
    fields = ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"]
    body = server.post("/infill", json={
        "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra, "prompt": "res", "n_predict": 16,
        "stop": [], "n_indent": 8, "top_k": 40, "top_p": 0.90, "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 250, "response_fields": fields}).json()
    assert set(body) == set(fields)
    assert body["tokens_cached"] > 0, "the warmed extra context was reused"


def test_warm_only_then_session_reuse(server):
    warm = server.post("/infill", json={"input_prefix": PREFIX, "n_predict": 0, "session": "doc"}).json()
    assert warm["tokens_predicted"] == 0 and warm["content"] == "" and warm["session"] == "doc"
    body = server.post("/infill", json={"input_prefix": PREFIX + "result", "n_predict": 8, "session": "doc"}).json()
    assert body["tokens_cached"] >= warm["tokens_evaluated"] - 2  # all but the last token or two of the prefix
    slots = {s["session"]: s for s in server.get("/slots").json()}
    assert slots["doc"]["tokens"] >= body["tokens_evaluated"] and not slots["doc"]["busy"]
    assert slots["doc"]["cache_bytes"] > 0 and slots["doc"]["drafters"]


def test_diverging_prompt_truncates_the_drafters(server):
    """An edit above the cursor: the session's history is cut back to the common prefix, and every drafter is told."""
    server.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "id_slot": 3})  # creates session slot-3
    calls = []

    def spy(engine):
        chain = engine.sessions["slot-3"].chain
        original = chain.truncate
        chain.truncate = lambda new_len: (calls.append(new_len), original(new_len))[1]

    server.app.state.scheduler.call(spy)
    text = "def alpha():\n    return 1\n" * 3
    server.post("/v1/completions", json={"prompt": text, "max_tokens": 8, "id_slot": 3})
    calls.clear()
    edited = text.replace("alpha", "beta", 2)
    server.post("/v1/completions", json={"prompt": edited, "max_tokens": 8, "id_slot": 3})
    assert calls, "the drafters were not told about the rewrite"
    tokens = server.app.state.engine.tokenizer(text).input_ids
    edited_tokens = server.app.state.engine.tokenizer(edited).input_ids
    common = next(i for i, (a, b) in enumerate(zip(tokens, edited_tokens)) if a != b)
    assert calls[0] == common


def test_sixteen_concurrent_clients_get_sequential_results(engine):
    rng = np.random.default_rng(11)
    prompts = [random_prompt(rng, int(rng.integers(10, 60)), repetitive=bool(i % 2)) for i in range(16)]
    texts = [engine.tokenizer.decode(p) for p in prompts]
    expected = [engine.generate(t, SamplingParams(max_tokens=24)).text for t in texts]
    app = create_app(engine, ServerConfig(parallel=8))  # half of them wait in the queue
    with live_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        def ask(index):
            stream = index % 2 == 0
            request = {"prompt": texts[index], "max_tokens": 24, "stream": stream, "session": f"c{index % 5}"}
            if not stream:
                return client.post("/v1/completions", json=request).json()["choices"][0]["text"]
            with client.stream("POST", "/v1/completions", json=request) as r:
                return "".join(e["choices"][0]["text"] for e in sse_events(r)[:-1])

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(ask, range(16)))
        assert results == expected
        assert metric(client, "codespec_requests_total") >= 16
        assert metric(client, "codespec_queue_depth") == 0


def test_disconnect_cancels_a_running_stream_and_frees_the_slot(server):
    app = server.app
    request = {"prompt": "import os\n", "max_tokens": 400, "stream": True, "session": "gone"}
    with server.stream("POST", "/v1/completions", json=request) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it is running
        gate = gate_worker(app)  # it cannot finish while the client leaves
    wait_until(lambda: app.state.metrics.cancelled._value.get() == 1)
    gate.set()
    wait_until(lambda: app.state.scheduler.active == 0)
    assert metric(server, 'codespec_generated_tokens_total') < 400
    assert not {s["session"]: s for s in server.get("/slots").json()}["gone"]["busy"]
    assert server.post("/v1/completions", json={"prompt": "import os\n", "max_tokens": 4,
                                                "session": "gone"}).status_code == 200


def test_disconnect_while_queued_cancels_before_it_runs(engine):
    app = create_app(engine, ServerConfig(parallel=1))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        gate = occupy(app)
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json={"prompt": "import os\n", "max_tokens": 8}, timeout=0.5)
        wait_until(lambda: app.state.metrics.cancelled._value.get() == 1)
        wait_until(lambda: app.state.scheduler.queued == 0)  # dropped from the queue, never started
        assert app.state.scheduler.active == 1  # (the job holding the slot)
        gate.set()
        wait_until(lambda: app.state.scheduler.active == app.state.scheduler.queued == 0)
        assert metric(client, "codespec_generated_tokens_total") == 0


def test_queue_full_is_429(engine):
    app = create_app(engine, ServerConfig(max_queue=1, parallel=1))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        gate = occupy(app)
        waiting = ThreadPoolExecutor(1).submit(client.post, "/v1/completions", json={"prompt": "a b", "max_tokens": 2})
        wait_until(lambda: app.state.scheduler.queued == 1)
        refused = client.post("/v1/completions", json={"prompt": "c d", "max_tokens": 2})
        gate.set()
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        assert waiting.result().status_code == 200


ERROR_CASES = [
    # (path, body or raw bytes, status, words in the message); an invalid body is llama-server's 400 on llama.cpp's
    # routes, 422 on OpenAI's
    ("/infill", b"{not json", 400, "JSON"),
    ("/infill", b"[1, 2]", 400, "dictionary"),
    ("/infill", {"n_predict": "many"}, 400, "n_predict"),
    ("/infill", {"input_prefix": 5}, 400, "input_prefix"),
    ("/infill", {"top_p": 1.5}, 400, "top_p"),
    ("/infill", {"temperature": -1}, 400, "temperature"),
    ("/infill", {"n_predict": -2}, 400, "n_predict"),
    ("/infill", {"input_prefix": "x", "speculative.n_max": 1000}, 400, "n_max"),
    ("/infill", {"input_prefix": "x", "spec": "warp-drive"}, 400, "unknown spec"),
    ("/infill", {"input_prefix": "x", "draft_max": 4, "draft_min": 8}, 400, "draft-min"),
    ("/infill", {"input_prefix": "x", "session": "bad name!"}, 400, "session"),
    ("/infill", {"input_prefix": "", "input_suffix": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "context"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -2}, 422, "max_tokens"),  # 0 warms, -1 is no limit
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n_predict": -2}, 422, "n_predict"),
    ("/completion", {"prompt": [1, 2], "n_predict": -5}, 400, "n_predict"),
    ("/completion", {"prompt": [10 ** 9]}, 400, "vocabulary"),
    ("/completion", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": "x", "n": 9}, 422, "n"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 422, "one prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 20}, 422, "stop"),
    ("/v1/completions", {}, 422, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 422, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 422, "role"),
    ("/infill", {"input_prefix": "x" * (70 << 10)}, 413, "over"),
    # a lone UTF-16 surrogate is no text: the tokenizer raised on it (a plain-text 500)
    ("/infill", b'{"input_prefix": "a\\ud800b"}', 400, "input_prefix"),
    ("/infill", b'{"input_prefix": "a", "input_extra": [{"text": "\\udc00"}]}', 400, "input_extra.0.text"),
    ("/v1/completions", b'{"prompt": "a\xed\xa0\x80b"}', 422, "prompt"),  # the raw bytes of U+D800
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 422, "content"),
    ("/v1/completions", b'{"prompt": "a", "suffix": "\\ud800"}', 422, "suffix"),
    # float32 sampling turns these into inf or 0: they passed validation and crashed it (a 500)
    ("/v1/completions", {"prompt": "x", "temperature": 1e-39}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 1.0, "top_p": 5e-324}, 422, "top_p"),
]


@pytest.mark.parametrize("path, body, status, words", ERROR_CASES)
def test_client_mistakes_are_4xx_json(server, path, body, status, words):
    response = (server.post(path, content=body, headers={"content-type": "application/json"})
                if isinstance(body, bytes) else server.post(path, json=body))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and words.lower() in error["message"].lower()
    assert server.get("/health").json() == {"status": "ok"}  # still up


def test_form_encoded_json_body_is_read_as_json(server):
    """`curl -d '{...}'` without a content type, as llama.cpp accepts."""
    response = server.post("/v1/completions", content=b'{"prompt": "import os", "max_tokens": 2}',
                           headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200


def test_unknown_route_and_method_are_json(server):
    assert server.get("/nowhere").json()["error"]["code"] == 404
    wrong = server.get("/infill")
    assert wrong.json()["error"]["code"] == 405 and wrong.headers["allow"] == "POST"  # RFC 9110: 405 says Allow


def test_a_chunked_body_over_the_limit_is_413(server):
    """Without a Content-Length the limit is found while reading (it was a 400 "error parsing the body")."""
    def chunks():
        for _ in range(5):
            yield b" " * (16 << 10)

    response = server.post("/infill", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == 413


def test_empty_response_fields_return_the_whole_body(server):
    """llama.cpp returns every field for `response_fields: []` (codespec returned {})."""
    body = server.post("/infill", json={"input_prefix": PREFIX, "n_predict": 2, "response_fields": []}).json()
    assert {"content", "timings", "tokens_cached"} <= set(body)


def break_generation(monkeypatch, engine, after_chunks: int):
    """The engine raises a bug's exception after yielding `after_chunks` chunks of a generation."""
    from codespec.decode import next_output

    original = engine.stream_steps

    def stream_steps(*args, **kwargs):
        steps = original(*args, **kwargs)
        for _ in range(after_chunks):
            yield (yield from next_output(steps))
        raise RuntimeError("a bug in the engine")

    monkeypatch.setattr(engine, "stream_steps", stream_steps)


def test_an_internal_error_is_a_json_500_and_the_server_goes_on(monkeypatch, engine, server):
    break_generation(monkeypatch, engine, after_chunks=0)
    response = server.post("/v1/completions", json={"prompt": "import os\n", "max_tokens": 8})
    assert response.status_code == 500
    assert response.json()["error"]["code"] == 500 and response.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert server.post("/v1/completions", json={"prompt": "import os\n", "max_tokens": 8}).status_code == 200


@pytest.mark.parametrize("path, body, done", [
    ("/v1/completions", {"prompt": "import os\n"}, True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}, True),
    ("/infill", {"input_prefix": PREFIX, "n_predict": 16}, False),
])
def test_an_error_mid_stream_ends_with_an_error_event(monkeypatch, engine, server, path, body, done):
    """The status line is sent already: the stream says what went wrong and ends as usual (was: a cut connection)."""
    break_generation(monkeypatch, engine, after_chunks=2)
    with server.stream("POST", path, json=body | {"stream": True, "max_tokens": 16}) as response:
        assert response.status_code == 200
        events = sse_events(response)
    ending = events[-2:] if done else events[-1:]
    assert ending[0]["error"]["code"] == 500 and ending[0]["error"]["type"] == "server_error"
    assert (events[-1] == "[DONE]") == done


def test_api_key(engine):
    app = create_app(engine, ServerConfig(api_key="s3cret"))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        request = {"prompt": "import os", "max_tokens": 2}
        assert client.get("/health").status_code == 200  # probes need no key
        assert client.post("/v1/completions", json=request).status_code == 401
        wrong = client.post("/v1/completions", json=request, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert client.get("/metrics").status_code == 401
        right = client.post("/v1/completions", json=request, headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200


def test_models_metrics_and_openapi(server):
    # (a prompt longer than ngram-mod's 24-token window: the pool learns from this request alone)
    done = server.post("/v1/completions", json={"prompt": "import os\n" * 8 + "import", "max_tokens": 8})
    assert done.status_code == 200, done.text
    models = server.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "codespec"
    text = server.get("/metrics").text
    for name in ("codespec_requests_total", "codespec_generated_tokens_total", "codespec_queue_depth",
                 "codespec_request_seconds_bucket", "codespec_time_to_first_token_seconds_bucket",
                 'codespec_draft_tokens_total{drafter="prompt-lookup"}', "codespec_draft_acceptance_ratio",
                 "codespec_sessions", "codespec_session_cache_bytes", "codespec_batched_forwards",
                 "codespec_shared_forwards"):
        assert name in text, name
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["codespec_batched_forwards"] >= 8  # the completion's forwards ran through the batched tick
    assert 0 < values["codespec_pool_occupancy"] < 1  # the default chain's ngram-mod pool learnt the prompt
    assert values["codespec_batch_invariant"] in (0.0, 1.0)  # float64 tiny model: PyTorch's path, so 0
    if not os.environ.get("CODESPEC_COSTS"):  # every step priced: the host's share and each call, learnt (unless
        # a pinned cost table says not to learn: the integration tests' conftest pins one for the whole run)
        assert 0 < values["codespec_step_host_seconds"] < 1
        assert 0 < values['codespec_drafter_call_seconds{drafter="prompt-lookup"}'] < 0.1
    else:
        assert values["codespec_step_host_seconds"] == 0
    spec = server.get("/openapi.json").json()
    validate(spec)
    assert {"/infill", "/v1/completions", "/v1/chat/completions", "/health", "/v1/models", "/metrics",
            "/slots"} <= set(spec["paths"])


def test_requests_naming_no_session_land_on_the_slot_that_shares_their_prefix(server):
    first = server.post("/infill", json={"input_prefix": PREFIX, "n_predict": 4}).json()
    other = server.post("/infill", json={"input_prefix": "class Point:\n    def __init__(self):\n",
                                         "n_predict": 4}).json()
    again = server.post("/infill", json={"input_prefix": PREFIX + "result += value\n", "n_predict": 4}).json()
    assert first["session"] != other["session"], "an empty slot is taken before another's cache is overwritten"
    assert again["session"] == first["session"] and again["tokens_cached"] >= first["tokens_evaluated"] - 2
