"""What clients already speak, on the tiny model: llama.cpp's n_predict (0 warms, absent runs to the end) and
response_fields on every route, llama.vim's warm-ups giving way to the request that follows them, llama.cpp's
/completion, and OpenAI's conventions (unknown models, parameters codespec cannot honour, include_usage)."""

import threading
import time

import httpx
import pytest

from codespec.cli import options as cli
from codespec.config import SamplingParams, ServerConfig, SpecConfig
from codespec.engine import Engine
from codespec.server import create_app
from tests.serving import live_server, sse_events
from tests.tiny import EOS

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
LONG_SYSTEM = "You edit text. " + " ".join(f"line {i} of the context" for i in range(48))  # ~460 tokens


@pytest.fixture
def server(engine):
    app = create_app(engine, ServerConfig(slots=2), model_name="SmolLM2-135M-Instruct",
                     model_aliases=("smollm2", "default"))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        client.app = app
        yield client


def chat_ids(engine, messages) -> list[int]:
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))


# -- n_predict / max_tokens ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "import os\n"}),
    ("/completion", {"prompt": "import os\n"}),
    ("/infill", {"input_prefix": "import os\n"}),
])
@pytest.mark.parametrize("limit", [{"n_predict": 0}, {"max_tokens": 0}, {"n_predict": 0, "max_tokens": 50}])
def test_zero_only_warms_the_cache_on_every_route(server, path, body, limit):
    """llama.vim's warm-ups: the chat route ignored n_predict and generated 256 tokens (26-45 s on the default
    model); with response_fields [""] the answer is {} as llama.cpp's."""
    session = {"session": f"warm-{path.strip('/').replace('/', '-')}"}
    warm = server.post(path, json=body | limit | session)
    assert warm.status_code == 200, warm.text
    answer = warm.json()
    generated = answer.get("tokens_predicted", answer.get("usage", {}).get("completion_tokens"))
    assert generated == 0
    text = answer.get("content", answer.get("choices", [{}])[0].get("text",
                      answer.get("choices", [{}])[0].get("message", {}).get("content")))
    assert text == ""
    slot = {s["session"]: s for s in server.get("/slots").json()}[session["session"]]
    assert slot["cached"] >= slot["tokens"] - 1 > 0  # the prompt is in the cache, all but its last token
    selected = body | limit | session | {"response_fields": [""], "stream": True}
    if path.startswith("/v1/"):  # an OpenAI client reads a stream: its last chunk, then [DONE]
        with server.stream("POST", path, json=selected) as response:
            events = sse_events(response)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 0
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
    else:  # llama.cpp's routes answer a warm-up with its body, as llama.vim expects
        assert server.post(path, json=selected).json() == {}


def test_no_limit_runs_to_the_end_of_the_text_or_the_context(engine, server):
    """llama.vim's instructions set no limit: they were cut at the server's 256 tokens. The tiny model never says
    EOS on this prompt, so it runs into the end of its 512-token context."""
    ids = chat_ids(engine, CHAT)
    expected = engine.generate(ids, SamplingParams(max_tokens=engine.context_length))
    assert len(expected.tokens) > 256 and expected.finish_reason == "length"
    body = server.post("/v1/chat/completions", json={"messages": CHAT, "spec": "none"}).json()
    assert body["choices"][0]["message"]["content"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.tokens) == engine.context_length - len(ids)
    assert body["choices"][0]["finish_reason"] == "length"
    assert server.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": -1}).json()["usage"][
        "completion_tokens"] == len(expected.tokens)


def test_n_predict_comes_before_max_tokens_and_the_server_caps_both(engine):
    app = create_app(engine, ServerConfig(n_predict=12))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        def generated(path, body):
            answer = client.post(path, json=body).json()
            return answer["tokens_predicted"] if "tokens_predicted" in answer else answer["usage"]["completion_tokens"]

        assert generated("/v1/completions", {"prompt": "import os\n"}) == 12  # no limit: the server's
        assert generated("/v1/completions", {"prompt": "import os\n", "max_tokens": 500}) == 12  # capped
        assert generated("/v1/completions", {"prompt": "import os\n", "max_tokens": 7}) == 7
        assert generated("/v1/completions", {"prompt": "import os\n", "n_predict": 5, "max_tokens": 9}) == 5
        assert generated("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 4}) == 4
        assert generated("/v1/chat/completions", {"messages": CHAT, "n_predict": 3}) == 3
        assert generated("/infill", {"input_prefix": "import os\n", "max_tokens": 6}) == 6
        assert generated("/infill", {"input_prefix": "import os\n"}) == 12
        assert generated("/completion", {"prompt": "import os\n", "n_predict": -1}) == 12


def test_n_predict_option():
    args = cli.build_parser().parse_args(["serve", "-n", "64"])
    assert cli.serve_n_predict(args) == 64
    assert cli.serve_n_predict(cli.build_parser().parse_args(["serve"])) == ServerConfig.n_predict == -1
    with pytest.raises(ValueError, match="n-predict"):
        ServerConfig(n_predict=0).validate()


def test_config_files_sampling_max_tokens_is_the_servers_default(tmp_path):
    config = tmp_path / "codespec.toml"
    config.write_text("[sampling]\nmax_tokens = 40\n")
    assert cli.serve_n_predict(cli.build_parser().parse_args(["serve", "--config", str(config)])) == 40
    assert cli.serve_n_predict(cli.build_parser().parse_args(["serve", "--config", str(config), "-n", "9"])) == 9


def test_response_fields_on_chat_and_completions(server):
    fields = ["choices", "usage/completion_tokens", "timings/prompt_n"]
    body = server.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4,
                                                     "response_fields": fields}).json()
    assert set(body) == set(fields) and body["usage/completion_tokens"] == 4
    assert body["choices"][0]["message"]["role"] == "assistant"
    body = server.post("/v1/completions", json={"prompt": "x = 1\n", "max_tokens": 3,
                                                "response_fields": ["usage/total_tokens"]}).json()
    assert list(body) == ["usage/total_tokens"]


# -- a warm-up gives way to the request that follows it -----------------------------------------------------------


@pytest.fixture
def slow_server(engine, monkeypatch):
    """Every forward takes 100 ms more and prompts go in chunks of 16 tokens: a long prompt's prefill takes seconds,
    so a request can arrive in the middle of it."""
    import codespec.scheduler

    original = codespec.scheduler.forward_batch

    def slow(*args, **kwargs):
        time.sleep(0.1)
        return original(*args, **kwargs)

    monkeypatch.setattr(codespec.scheduler, "forward_batch", slow)
    app = create_app(engine, ServerConfig(slots=2, prefill_chunk=16))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def slot(client, name):
    return {s["session"]: s for s in client.get("/slots").json()}.get(name)


def start_warm_up(client, body) -> tuple[threading.Thread, dict]:
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(client.post("/v1/chat/completions", json=body).json()))
    thread.start()
    return thread, answer


def test_an_instruction_does_not_wait_for_its_warm_up(engine, slow_server):
    """llama.vim's :LlamaInstruct: a warm-up (n_predict 0, the selection's context, an empty instruction) and, as
    soon as the instruction is typed, the instruction on the same id_slot. The warm-up ends at its next chunk; the
    instruction reuses the chunks it computed and prefills the rest itself (before: it waited for the whole
    warm-up, which even generated 256 tokens)."""
    warm_messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": ""}]
    real_messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "INSTRUCTION: fix"}]
    warm_ids, real_ids = chat_ids(engine, warm_messages), chat_ids(engine, real_messages)
    assert len(warm_ids) > 16 * 25  # 25 chunks of 16: 2.5 s of forwards at least
    thread, warm = start_warm_up(slow_server, {"id_slot": 5, "messages": warm_messages, "samplers": [],
                                               "n_predict": 0, "stream": False, "cache_prompt": True})
    deadline = time.monotonic() + 30
    while not (slot(slow_server, "slot-5") or {}).get("cached"):
        assert time.monotonic() < deadline, "the warm-up never started"
        time.sleep(0.01)
    real = slow_server.post("/v1/chat/completions", json={"id_slot": 5, "messages": real_messages,
                                                          "n_predict": 8, "spec": "none"}).json()
    thread.join(60)
    reused = real["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < reused < len(warm_ids) // 2, "the instruction waited for the warm-up to finish"
    assert warm["usage"]["completion_tokens"] == 0
    expected = engine.generate(real_ids, SamplingParams(max_tokens=8), spec=None)
    assert real["choices"][0]["message"]["content"] == expected.text  # the shortened warm-up's cache is sound


def test_a_request_naming_no_slot_takes_over_a_warming_slot(engine, slow_server):
    """A slot that only runs a warm-up is not busy for a request that shares its prompt: it takes that slot (and
    its cache so far) instead of starting cold on another one."""
    warm_messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": ""}]
    thread, warm = start_warm_up(slow_server, {"messages": warm_messages, "n_predict": 0})
    deadline = time.monotonic() + 30
    while not any(s["cached"] and s["busy"] for s in slow_server.get("/slots").json()):
        assert time.monotonic() < deadline, "the warm-up never started"
        time.sleep(0.01)
    real = slow_server.post("/v1/chat/completions", json={
        "messages": warm_messages[:1] + [{"role": "user", "content": "INSTRUCTION: fix"}], "max_tokens": 2}).json()
    thread.join(60)
    assert real["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert warm["usage"]["completion_tokens"] == 0


def test_a_request_refused_for_a_full_queue_does_not_end_a_warm_up(engine, monkeypatch):
    import codespec.scheduler

    original = codespec.scheduler.forward_batch
    monkeypatch.setattr(codespec.scheduler, "forward_batch", lambda *a, **k: (time.sleep(0.1), original(*a, **k))[1])
    app = create_app(engine, ServerConfig(max_queue=1, parallel=1, prefill_chunk=16))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": ""}]
        thread, warm = start_warm_up(client, {"id_slot": 5, "messages": messages, "n_predict": 0})
        deadline = time.monotonic() + 30
        while not (slot(client, "slot-5") or {}).get("cached"):
            assert time.monotonic() < deadline, "the warm-up never started"
            time.sleep(0.01)
        queued = threading.Thread(target=client.post, args=("/v1/completions",),
                                  kwargs={"json": {"prompt": "import os\n", "max_tokens": 2, "session": "other"}})
        queued.start()  # waits: the one active place is the warm-up's
        while app.state.scheduler.queued < 1:
            time.sleep(0.01)
        refused = client.post("/v1/chat/completions", json={"id_slot": 5, "messages": messages, "max_tokens": 2})
        assert refused.status_code == 429
        thread.join(60)
        queued.join(60)
        warmed = slot(client, "slot-5")
        assert warmed["cached"] == warmed["tokens"] - 1, "the refused request ended the warm-up"


# -- llama.cpp's /completion ----------------------------------------------------------------------------------------


def test_llama_cpp_completion_takes_text_or_token_ids(engine, server):
    expected = engine.generate("import os\n", SamplingParams(max_tokens=10))
    body = server.post("/completion", json={"prompt": "import os\n", "n_predict": 10}).json()
    assert body["content"] == expected.text and body["tokens_predicted"] == 10
    ids = engine.encode("import os\n")
    assert server.post("/completion", json={"prompt": ids, "n_predict": 10}).json()["content"] == expected.text
    with server.stream("POST", "/completion", json={"prompt": ids, "n_predict": 10, "stream": True}) as response:
        events = sse_events(response)
    assert "".join(e["content"] for e in events) == expected.text and events[-1]["stop"]
    tokens = server.post("/v1/completions", json={"prompt": ids, "max_tokens": 10}).json()
    assert tokens["choices"][0]["text"] == expected.text


# -- OpenAI's conventions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
                                        ("/v1/completions", {"prompt": "import os", "max_tokens": 2})])
def test_unknown_model_is_openais_404(server, path, body):
    """It was a 200 from whatever model was loaded."""
    response = server.post(path, json=body | {"model": "gpt-4o"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "model"
    assert error["code"] == "model_not_found" and "gpt-4o" in error["message"]
    listed = server.get("/v1/models").json()["data"][0]["id"]
    for known in (listed, "smollm2", "default", "", None):  # its id, the documented aliases, none (llama.vim)
        assert server.post(path, json=body | {"model": known}).status_code == 200, known
    assert server.get(f"/v1/models/{listed}").json()["id"] == listed
    assert server.get("/v1/models/gpt-4o").json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # (without logprobs: true)
    ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -1.0}, "frequency_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"4200000": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"prompt": [1, 2], "suffix": "x"}, "suffix"),
])
def test_what_codespec_cannot_honour_is_a_400_that_names_it(server, path, extra, param):
    body = {"messages": CHAT} if "chat" in path else {"prompt": "import os"}
    response = server.post(path, json=body | {"max_tokens": 2} | extra)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_openais_neutral_values_and_service_fields_are_accepted(server):
    neutral = {"logprobs": False, "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
               "logit_bias": {}, "response_format": {"type": "text"}, "tool_choice": "none", "modalities": ["text"],
               "n": 1, "user": "someone", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
               "seed": 3, "stop": ["\n\n", "###"], "parallel_tool_calls": True, "stream": None, "n_predict": None}
    assert server.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2} | neutral).status_code == 200
    assert server.post("/v1/completions", json={"prompt": "import os", "max_tokens": 2, "best_of": 1, "echo": False,
                                                "suffix": None, "n": None}).status_code == 200


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": CHAT}),
                                        ("/v1/completions", {"prompt": "import os"})])
def test_include_usage_adds_openais_usage_chunk(server, path, body):
    request = body | {"max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with server.stream("POST", path, json=request) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    with server.stream("POST", path, json=body | {"max_tokens": 4, "stream": True}) as response:
        assert all(e == "[DONE]" or e["choices"] for e in sse_events(response))


def test_the_server_measures_its_cost_table_before_any_request(model, tokenizer, monkeypatch):
    """The adaptive cost table is measured on the engine's worker as the app is made (~4 s with the default model
    on a machine with no table for this code), not in the first request."""
    monkeypatch.delenv("CODESPEC_COSTS", raising=False)  # the integration tests pin a table for every engine
    engine = Engine(model, tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}))
    assert engine._costs is None
    app = create_app(engine, ServerConfig())
    try:
        assert app.state.costs.result(timeout=120) is engine._costs is not None
    finally:
        app.state.scheduler.close()
