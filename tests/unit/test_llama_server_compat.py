"""codespec as a drop-in llama-server, on the tiny model: llama-server's routes (/props, /tokenize, /detokenize,
/apply-template) and aliases (/completions, /chat/completions, /models, /v1/health), its API-key header, its error
shapes (400 for an invalid body on its routes, exceed_context_size_error), the response fields its clients read,
/slots' and /metrics' llama-server names, and `codespec serve` started with llama-server's flags."""

import threading
import time

import httpx
import numba
import pytest
import torch
from openapi_spec_validator import validate
from tokenizers import processors

from codespec import __version__
from codespec.cli import commands
from codespec.cli import options as cli
from codespec.config import SamplingParams, ServerConfig, SpecConfig
from codespec.engine import Engine
from codespec.forward.models import DEFAULT_ALIASES, DEFAULT_NAME
from codespec.server import create_app
from codespec.server.routes import ALIASES, ROUTERS
from tests.serving import live_server, sse_events
from tests.tiny import EOS, tiny_tokenizer

BUILD = f"codespec-{__version__}"
CHAT = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
REPETITIVE = "def f(x):\n    return x\n" * 6  # prompt-lookup drafts on it
NEWLINE = "def total(values):\n    result = 0\n    for value in values:\n        "  # the tiny model writes a newline
PREFIX = "def total(values):\n    result = 0\n    for value in values:\n        "


SPEC = SpecConfig(adaptive=False)  # every draft verified whole: how much is drafted does not depend on timing


@pytest.fixture
def server(engine):
    app = create_app(engine, ServerConfig(slots=2, parallel=3, n_predict=40),
                     SamplingParams(top_k=5, top_p=0.9, seed=7), SPEC, model_name="tiny", model_aliases=("tiny-2",),
                     model_path="/models/tiny.gguf")
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        client.app = app
        yield client


def metrics(client) -> dict[str, float]:
    """Every sample of /metrics by its name and labels."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in client.get("/metrics").text.splitlines() if line and not line.startswith("#")}


def wait_until(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# -- /props ----------------------------------------------------------------------------------------------------------


def test_props_reports_the_engine_and_the_servers_defaults(engine, server):
    props = server.get("/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == engine.context_length == 512
    assert settings["is_processing"] is False and settings["speculative"] is True
    params = settings["params"]
    assert (params["n_predict"], params["top_k"], params["top_p"], params["seed"], params["temperature"]) == \
        (40, 5, 0.9, 7, 0.0)
    assert params["speculative.n_max"] == SPEC.draft_max and params["spec"] == list(SPEC.spec)
    assert props["total_slots"] == 3 and props["model_path"] == "/models/tiny.gguf"
    assert props["model_alias"] == "tiny" and props["build_info"] == BUILD
    assert props["chat_template"] == engine.tokenizer.chat_template and props["chat_template"]
    # a request that sets nothing runs with exactly these settings (its n_predict: the server's cap)
    answer = server.post("/completion", json={"prompt": "import os\n"}).json()
    assert answer["generation_settings"] == {**params, "n_ctx": 512} and answer["tokens_predicted"] == 40


# -- /tokenize, /detokenize, /apply-template ---------------------------------------------------------------------------


def test_tokenize_and_detokenize_as_llama_server(engine, server):
    text = "héllo wörld <eos> x"
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids
    assert EOS in ids  # special tokens' text is parsed by default
    assert server.post("/tokenize", json={"content": text}).json() == {"tokens": ids}
    plain = server.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
    assert EOS not in plain and len(plain) > len(ids)
    pieces = server.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [piece["id"] for piece in pieces] == ids
    assert {"id": EOS, "piece": "<eos>"} in pieces
    split = [piece for piece in pieces if isinstance(piece["piece"], list)]  # é and ö: two tokens each
    assert len(split) == 4 and all(len(piece["piece"]) == 1 for piece in split)
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert joined == text.encode()
    assert server.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    assert server.post("/detokenize", json={"tokens": plain}).json() == {"content": text}
    assert server.post("/detokenize", json={"tokens": []}).json() == {"content": ""}
    outside = server.post("/detokenize", json={"tokens": [1, 384]})
    assert outside.status_code == 400 and "vocabulary" in outside.json()["error"]["message"]


def test_add_special_adds_the_bos_a_prompt_gets(model):
    """llama-server's default is false; true gives the tokens a text prompt starts with."""
    tokenizer = tiny_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<eos> $A", special_tokens=[("<eos>", EOS)])  # a BOS (the tiny vocabulary's only special token)
    engine = Engine(model, tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}))
    with live_server(create_app(engine)) as url:
        bare = httpx.post(f"{url}/tokenize", json={"content": "import os"}).json()["tokens"]
        special = httpx.post(f"{url}/tokenize", json={"content": "import os", "add_special": True}).json()["tokens"]
        assert special == [EOS, *bare] == engine.encode("import os")
        answer = httpx.post(f"{url}/completion", json={"prompt": "import os", "n_predict": 1}, timeout=60).json()
        assert answer["tokens_evaluated"] == len(special)


def test_apply_template_is_the_prompt_chat_completions_continues(engine, server):
    prompt = server.post("/apply-template", json={"messages": CHAT}).json()["prompt"]
    system = [{"role": "system", "content": "Be brief."}, CHAT[1]]  # OpenAI's developer is the template's system
    assert prompt == engine.tokenizer.apply_chat_template(system, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("assistant: ")
    ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
    chat = server.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 12}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    continued = server.post("/completion", json={"prompt": ids, "n_predict": 12}).json()
    assert continued["content"] == chat["choices"][0]["message"]["content"]


# -- aliases -----------------------------------------------------------------------------------------------------------


def test_aliases_are_the_same_handlers(server):
    endpoints = {route.path: route.endpoint for router in ROUTERS for route in router.routes}
    for alias, path in ALIASES.items():
        assert endpoints[alias] is endpoints[path], alias
    request = {"prompt": "import os\n", "max_tokens": 8}
    v1, bare = (server.post(path, json=request).json() for path in ("/v1/completions", "/completions"))
    assert bare["object"] == "text_completion" and bare["choices"][0]["text"] == v1["choices"][0]["text"]
    chat = {"messages": CHAT, "max_tokens": 8}
    v1, bare = (server.post(path, json=chat).json() for path in ("/v1/chat/completions", "/chat/completions"))
    assert bare["object"] == "chat.completion"
    assert bare["choices"][0]["message"]["content"] == v1["choices"][0]["message"]["content"]
    assert server.get("/models").json() == server.get("/v1/models").json()
    assert server.get("/models").json()["data"][0]["id"] == "tiny"
    assert server.get("/v1/health").json() == {"status": "ok"}
    assert server.post("/models").status_code == 405  # the route's own methods
    spec = server.get("/openapi.json").json()
    validate(spec)
    assert {"/props", "/tokenize", "/detokenize", "/apply-template"} <= set(spec["paths"])
    assert not set(ALIASES) & set(spec["paths"])  # each handler listed once


# -- the API key -------------------------------------------------------------------------------------------------------


def test_x_api_key_is_taken_as_bearer_is(engine):
    app = create_app(engine, ServerConfig(api_key="alice-key,bob-key"))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        request = {"prompt": "import os\n", "n_predict": 2}
        assert client.post("/completion", json=request, headers={"x-api-key": "alice-key"}).status_code == 200
        for headers in ({}, {"x-api-key": "nope"}, {"x-api-key": "Bearer alice-key"}, {"x-api-key": ""}):
            refused = client.post("/completion", json=request, headers=headers)
            assert refused.status_code == 401 and "X-Api-Key" in refused.json()["error"]["message"], headers
        assert client.get("/props").status_code == 401
        assert client.get("/props", headers={"x-api-key": "bob-key"}).status_code == 200
        for path in ("/health", "/v1/health"):  # probes need no key
            assert client.get(path).json() == {"status": "ok"}
        # a key is one tenant whichever header carries it
        client.post("/infill", json={"input_prefix": PREFIX, "n_predict": 0, "session": "notes"},
                    headers={"x-api-key": "alice-key"})
        sessions = lambda headers: {s["session"] for s in client.get("/slots", headers=headers).json()}  # noqa: E731
        assert "notes" in sessions({"authorization": "Bearer alice-key"})
        assert "notes" not in sessions({"x-api-key": "bob-key"})


# -- errors ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, words", [
    ("/completion", {"prompt": "x", "n_predict": "8"}, "n_predict"),
    ("/infill", {"input_prefix": 5}, "input_prefix"),
    ("/infill", b"null", "dictionary"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/apply-template", {"messages": []}, "messages"),
])
def test_an_invalid_body_on_a_llama_cpp_route_is_400(server, path, body, words):
    response = (server.post(path, content=body, headers={"content-type": "application/json"})
                if isinstance(body, bytes) else server.post(path, json=body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and words in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}),
    ("/completions", {"prompt": "x", "max_tokens": "8"}),
    ("/v1/chat/completions", {"messages": []}),
    ("/chat/completions", {"messages": []}),
])
def test_openai_routes_keep_their_422(server, path, body):
    response = server.post(path, json=body)
    assert response.status_code == 422 and response.json()["error"]["code"] == 422


def test_a_prompt_longer_than_the_context_is_exceed_context_size_error(engine, server):
    """llama-server's 400, on its routes and OpenAI's: both numbers inside `error`. A prompt of n_ctx - 1 tokens
    still fits (one token can be generated), one of n_ctx does not."""
    n_ctx = engine.context_length
    assert server.post("/completion", json={"prompt": [5] * (n_ctx - 1), "n_predict": 4}).json()[
        "tokens_predicted"] == 1
    chat_ids = engine.encode("word " * 600, chat=True)
    cases = [("/completion", {"prompt": [5] * n_ctx}, n_ctx),
             ("/completion", {"prompt": [5] * n_ctx, "n_predict": 0}, n_ctx),  # a warm-up too
             ("/completion", {"prompt": [5] * 600, "stream": True}, 600),
             ("/v1/completions", {"prompt": [5] * 600}, 600),
             ("/completions", {"prompt": [5] * 600, "stream": True}, 600),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]}, len(chat_ids))]
    for path, body, tokens in cases:
        response = server.post(path, json=body)
        assert response.status_code == 400, (path, response.text)
        assert response.json() == {"error": {
            "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": tokens, "n_ctx": n_ctx,
            "message": f"request ({tokens} tokens) exceeds the available context size ({n_ctx} tokens), try "
                       "increasing it"}}, path
    assert server.get("/health").json() == {"status": "ok"}


# -- what clients read in the answers ----------------------------------------------------------------------------------


def test_completion_fields_llama_clients_read(engine, server):
    request = {"prompt": REPETITIVE, "n_predict": 24, "spec": "prompt-lookup", "session": "s", "temperature": 0.0}
    expected = engine.generate(REPETITIVE, SamplingParams(max_tokens=24))
    body = server.post("/completion", json=request | {"return_tokens": True}).json()
    assert body["content"] == expected.text and body["tokens"] == expected.tokens
    assert len(body["tokens"]) == body["tokens_predicted"] == 24
    assert engine.tokenizer.decode(body["tokens"], skip_special_tokens=True) == body["content"]
    timings, speculation = body["timings"], body["speculation"]
    assert timings["draft_n"] == speculation["drafted_tokens"] > 0
    assert timings["draft_n_accepted"] == speculation["accepted_tokens"]
    assert timings["cache_n"] == body["tokens_cached"] == 0
    settings = body["generation_settings"]
    assert (settings["n_predict"], settings["spec"], settings["stream"], settings["top_k"]) == \
        (24, ["prompt-lookup"], False, 5)
    again = server.post("/completion", json=request | {"prompt": REPETITIVE + "def g"}).json()
    assert again["tokens"] == [] and again["timings"]["cache_n"] == again["tokens_cached"] > 0
    newline = server.post("/completion", json={"prompt": NEWLINE, "n_predict": 24}).json()
    assert {body["has_new_line"], newline["has_new_line"]} == {False, True}
    for answer in (body, newline):
        assert answer["has_new_line"] == ("\n" in answer["content"])
    with server.stream("POST", "/completion", json=request | {"return_tokens": True, "stream": True,
                                                              "session": "t"}) as response:
        events = sse_events(response)
    last = events[-1]
    assert "".join(event["content"] for event in events) == body["content"]
    assert last["tokens"] == body["tokens"] and last["has_new_line"] == body["has_new_line"]
    assert last["generation_settings"] == settings | {"stream": True}
    fields = server.post("/completion", json=request | {"response_fields": ["generation_settings/n_predict",
                                                                            "timings/draft_n"]}).json()
    assert fields["generation_settings/n_predict"] == 24 and fields["timings/draft_n"] >= 0


def test_tokens_of_a_text_an_output_limit_cut(engine, server):
    """n_indent ends the suggestion at a line indented less: the engine's tokens went with the stopped job, so
    `tokens` are the returned text's. Uncut, they are the engine's: token healing gave the prompt's last whitespace
    back to the model, and the first token spells it again (not part of the content, which the prompt had)."""
    request = {"input_prefix": NEWLINE, "n_predict": 24, "n_indent": 12, "return_tokens": True}
    body = server.post("/infill", json=request).json()
    free = server.post("/infill", json=request | {"n_indent": 0}).json()
    assert len(body["content"]) < len(free["content"]) and free["content"].startswith(body["content"])
    assert body["stop_type"] == "limit" and body["tokens"]
    assert body["tokens"] == engine.tokenizer(body["content"], add_special_tokens=False).input_ids
    spelt = engine.tokenizer.decode(free["tokens"], skip_special_tokens=True)
    healed = spelt.removesuffix(free["content"])
    assert spelt.endswith(free["content"]) and healed.strip() == "" and healed and NEWLINE.endswith(healed)
    assert len(free["tokens"]) == free["tokens_predicted"]


def test_openai_answers_carry_system_fingerprint(server):
    for path, body in (("/v1/completions", {"prompt": "import os\n", "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})):
        assert server.post(path, json=body).json()["system_fingerprint"] == BUILD
        with server.stream("POST", path, json=body | {"stream": True,
                                                      "stream_options": {"include_usage": True}}) as response:
            events = sse_events(response)[:-1]
        assert len(events) >= 3 and all(event["system_fingerprint"] == BUILD for event in events)
    timings = server.post("/v1/completions", json={"prompt": REPETITIVE, "max_tokens": 24,
                                                   "spec": "prompt-lookup"}).json()["timings"]
    assert {"cache_n", "draft_n", "draft_n_accepted"} <= set(timings) and timings["draft_n"] > 0


# -- /slots and /metrics ----------------------------------------------------------------------------------------------


@pytest.fixture
def slow_server(engine, monkeypatch):
    """Every forward takes 50 ms more: a generation runs long enough to be seen running."""
    import codespec.scheduler

    original = codespec.scheduler.forward_batch

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return original(*args, **kwargs)

    monkeypatch.setattr(codespec.scheduler, "forward_batch", slow)
    app = create_app(engine, ServerConfig(slots=2))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def test_slots_and_metrics_in_llama_servers_names(engine, slow_server):
    client = slow_server
    client.post("/completion", json={"prompt": "import os\n", "n_predict": 2, "session": "plain", "spec": "none"})
    done = threading.Event()

    def stream():
        with client.stream("POST", "/completion", json={"prompt": REPETITIVE, "n_predict": 100, "session": "busy",
                                                         "spec": "prompt-lookup", "stream": True}) as response:
            sse_events(response)
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    slot = lambda name: {s["session"]: s for s in client.get("/slots").json()}.get(name)  # noqa: E731
    wait_until(lambda: (slot("busy") or {}).get("is_processing"))
    running = metrics(client)
    assert not done.is_set(), "the generation ended before it was seen running"
    assert running["llamacpp:requests_processing"] == 1 and running["llamacpp:requests_deferred"] == 0
    busy, plain = slot("busy"), slot("plain")
    listed = client.get("/slots").json()
    assert [s["id"] for s in listed] == list(range(len(listed)))  # llama-server's slot indexes: integers
    assert busy["busy"] and busy["n_ctx"] == engine.context_length and busy["speculative"]
    assert busy["params"]["spec"] == ["prompt-lookup"] and busy["params"]["speculative.n_max"] == engine.spec.draft_max
    assert not plain["is_processing"] and not plain["speculative"] and plain["params"]["spec"] == ["none"]
    assert done.wait(60)
    wait_until(lambda: not slot("busy")["is_processing"])
    assert metrics(client)["llamacpp:requests_processing"] == 0


def test_llamacpp_metrics_count_what_codespec_ran(server):
    answers = [server.post("/completion", json={"prompt": REPETITIVE, "n_predict": 16, "spec": "prompt-lookup"}),
               server.post("/infill", json={"input_prefix": PREFIX, "n_predict": 0}),  # a warm-up: prompt only
               server.post("/v1/completions", json={"prompt": "import os\n", "max_tokens": 8})]
    llama = [answer.json() for answer in answers[:2]]
    openai = answers[2].json()
    values = metrics(server)
    timings = [answer["timings"] for answer in llama] + [openai["timings"]]
    assert values["llamacpp:tokens_predicted_total"] == sum(t["predicted_n"] for t in timings) == 16 + 0 + 8
    assert values["llamacpp:prompt_tokens_total"] == sum(t["prompt_n"] for t in timings) > 0
    assert values["llamacpp:spec_decode_num_draft_tokens_total"] == sum(t["draft_n"] for t in timings) > 0
    assert values["llamacpp:spec_decode_num_accepted_tokens_total"] == sum(t["draft_n_accepted"] for t in timings)
    assert values["llamacpp:n_decode_total"] == values["codespec_batched_forwards"] > 0
    assert values["llamacpp:prompt_seconds_total"] > 0 and values["llamacpp:tokens_predicted_seconds_total"] > 0
    assert values["llamacpp:predicted_tokens_seconds"] == pytest.approx(
        values["llamacpp:tokens_predicted_total"] / values["llamacpp:tokens_predicted_seconds_total"])
    assert values["llamacpp:n_tokens_max"] == max(*(a["tokens_evaluated"] + a["tokens_predicted"] for a in llama),
                                                  openai["usage"]["total_tokens"])
    assert values["llamacpp:requests_processing"] == values["llamacpp:requests_deferred"] == 0


# -- `codespec serve` with llama-server's flags ------------------------------------------------------------------------


def parse(*argv):
    return cli.build_parser().parse_args(["serve", *argv])


def test_llama_server_flags_set_codespecs_settings(tmp_path):
    args = parse("-m", "model.gguf", "-md", "draft.gguf", "-ctk", "q8_0", "-ctv", "q8_0", "-t", "3",
                 "--alias", "coder,coder-2", "--spec-type", "ngram-simple,ngram-mod", "-c", "256", "-n", "9")
    model, spec, _ = cli.settings_from_args(args)
    assert (model.model, model.cache_type, model.context) == ("model.gguf", "q8", 256)
    assert spec.draft_model == "draft.gguf" and spec.spec == ("prompt-lookup", "ngram-mod")
    assert args.threads == 3 and cli.serve_n_predict(args) == 9
    assert cli.served_names(args.model, args.alias) == ("coder", ("coder-2", "model.gguf"))
    assert cli.served_names("smollm2") == (DEFAULT_NAME, tuple(sorted(DEFAULT_ALIASES - {DEFAULT_NAME})))
    assert parse("--spec-type", "draft-simple").spec == ("draft",)
    for flags in (["-ctk", "f16"], ["-ctv", "f16"], ["--cache-type-k", "f16", "--cache-type-v", "f16"],
                  ["--cache-type", "f16", "-ctk", "f16"]):
        assert cli.settings_from_args(parse(*flags))[0].cache_type == "f16", flags


@pytest.mark.parametrize("flags, words", [
    (["-ctk", "f16", "-ctv", "q8_0"], "-ctv q8 differs from the cache type given before (f16)"),
    (["--cache-type", "f32", "-ctv", "f16"], "-ctv f16 differs from the cache type given before (f32)"),
    (["-ctk", "q8_0", "--cache-type", "f16"], "--cache-type f16 differs from the cache type given before (q8)"),
    (["-ctk", "bf16"], "codespec's cache types are f32, f16 and q8_0"),
    (["--spec-type", "draft-eagle3"], "unknown spec 'draft-eagle3'"),
    (["-t", "0"], "0 is outside 1..4096"),
])
def test_llama_server_flags_codespec_cannot_honour_are_one_line(capsys, flags, words):
    with pytest.raises(SystemExit) as raised:
        parse(*flags)
    err = capsys.readouterr().err
    assert raised.value.code == 2 and words in err and err.count("\n") == 1, err


def test_threads_flag_with_replicas_is_refused(capsys):
    assert commands.main(["serve", "--replicas", "2", "-t", "2"]) == 1
    err = capsys.readouterr().err
    assert "--replica-cpus" in err and err.count("\n") == 1


def test_codespec_serve_with_llama_server_flags(monkeypatch, tiny_dir):
    """`codespec serve` as a llama-server command line starts it: the app it would serve, served here."""
    import uvicorn

    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.update(app=app))
    numba_threads = numba.get_num_threads()
    try:
        assert commands.main(["serve", "-m", str(tiny_dir), "--alias", "tiny-alias", "-t", "2", "-ctk", "f32",
                              "-ctv", "f32", "--spec-type", "ngram-simple", "--api-key", "k", "-c", "256"]) == 0
        assert torch.get_num_threads() == 2 and numba.get_num_threads() == min(2, numba.config.NUMBA_NUM_THREADS)
    finally:
        numba.set_num_threads(numba_threads)
    app = served["app"]
    assert app.state.engine.cache_type == "f32"  # (the default is auto)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60, headers={"x-api-key": "k"}) as client:
        props = client.get("/props").json()
        assert props["model_alias"] == "tiny-alias" and props["model_path"] == str(tiny_dir)
        assert props["default_generation_settings"]["n_ctx"] == 256
        assert props["default_generation_settings"]["params"]["spec"] == ["prompt-lookup"]
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-alias"
        request = {"messages": CHAT, "max_tokens": 2}
        for name in ("tiny-alias", str(tiny_dir), ""):  # the alias, the model's own name, none
            answer = client.post("/v1/chat/completions", json=request | {"model": name})
            assert answer.status_code == 200 and answer.json()["model"] == "tiny-alias", name
        assert client.post("/v1/chat/completions", json=request | {"model": "other"}).status_code == 404


def test_replicas_take_the_alias_and_x_api_key(tiny_dir):
    """`codespec serve --replicas`: its engines report the alias, and its gateway's own check (/replicas) takes
    X-Api-Key as the engines' apps do (built offline: nothing starts Ray)."""
    from starlette.requests import Request

    from codespec.replicas import app_builder
    from codespec.replicas.deploy import Gateway

    app = app_builder({"replicas": "2", "model": str(tiny_dir), "alias": "tiny-alias", "api_key": "k1,k2"})
    settings = app._bound_deployment.init_args[0]._bound_deployment.init_args[0]
    assert settings.model_name == "tiny-alias" and settings.model_aliases == (str(tiny_dir),)
    gateway = object.__new__(Gateway.func_or_class)
    gateway.api_keys = ("k1", "k2")

    def let_in(headers: dict) -> bool:
        scope = {"type": "http", "headers": [(name.encode(), value.encode()) for name, value in headers.items()]}
        return Gateway.func_or_class.authorized(gateway, Request(scope))

    assert let_in({"x-api-key": "k2"}) and let_in({"authorization": "Bearer k1"})
    assert not let_in({"x-api-key": "k3"}) and not let_in({}) and not let_in({"x-api-key": ""})
