"""The server under fuzzing, on the tiny model: schemathesis over every route of its own OpenAPI document (a few
examples each: the longer run is `python -m codespec.bench.fuzz_http`), the hand-made hostile requests, and 50
mid-stream disconnects in a row. Nothing may answer 5xx, hang, fail a schemathesis check or change the greedy
output of a normal request made afterwards."""

import pytest

from codespec.bench import fuzz_http
from codespec.config import SamplingParams, SpecConfig, ServerConfig
from codespec.engine import Engine
from codespec.server import create_app, uvicorn_options
from tests.serving import live_server
from tests.tiny import EOS, tiny_model

READ_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def url(tokenizer):
    """One server for the module; a 128-token context keeps the longest generation a fuzzer can ask for short."""
    engine = Engine(tiny_model(context=128), tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}))
    config = ServerConfig(read_timeout=READ_TIMEOUT)
    with live_server(create_app(engine, config), **uvicorn_options(config)) as base:
        base_engine = Engine(tiny_model(context=128), tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}))
        expected = base_engine.generate(fuzz_http.GREEDY["prompt"], SamplingParams(max_tokens=24)).text
        assert fuzz_http.greedy_text(base) == expected
        yield base
        assert fuzz_http.greedy_text(base) == expected, "fuzzing changed the greedy output"


def test_schemathesis_finds_nothing_on_any_route(url):
    """Its fuzzing phase, valid and invalid requests; the coverage phase (~800 boundary cases, ~1 min here) runs in
    the benchmark."""
    report = fuzz_http.fuzz_schema(url, examples=20, phases=("examples", "fuzzing"))
    assert report["server_errors"] == [] and report["hangs"] == [] and report["errors"] == []
    assert report["failures"] == []
    assert {route.split()[1] for route in report["requests"]} == {
        "/infill", "/completion", "/v1/completions", "/v1/chat/completions", "/health", "/v1/models",
        "/v1/models/{model}", "/metrics", "/slots", "/props", "/tokenize", "/detokenize", "/apply-template"}
    assert sum(report["requests"].values()) >= 50 and report["statuses"][200] > 0 and report["statuses"][422] > 0
    assert report["statuses"][400] > 0  # llama.cpp's routes refuse an invalid body with llama-server's 400


def test_hostile_requests_get_their_expected_answers(url):
    outcomes = fuzz_http.hostile_requests(url, READ_TIMEOUT)
    assert [case for case in outcomes if not case["ok"]] == []
    assert len(outcomes) >= 30


def test_fifty_mid_stream_disconnects_in_a_row(url):
    assert fuzz_http.disconnects(url, 50) == 50
