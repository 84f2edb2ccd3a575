"""Log-probabilities (OpenAI's logprobs / top_logprobs, llama.cpp's n_probs) on the tiny model: each generated
token's, read from the verify forward's rows, the same with and without speculation, in each dialect's shape."""

import math
from dataclasses import replace

import pytest

from tests.serving import sse_events, tiny_client

PROMPT = "def total(values):\n    result = 0\n    for value in values:\n" * 3  # repetitive: drafts get accepted


@pytest.fixture
def server(engine):
    engine.spec = replace(engine.spec, adaptive=False)  # drafts verified whatever this machine's load: they are
    with tiny_client(engine) as client:                  # what the comparison with plain decoding is about
        yield client


def completion(server, **body) -> dict:
    answer = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_completions_logprobs_are_each_tokens_and_the_same_with_and_without_drafts(server):
    plain = completion(server, logprobs=2, spec="none")["choices"][0]["logprobs"]
    drafted = completion(server, logprobs=2)
    assert drafted["speculation"]["accepted_tokens"] > 0
    logprobs = drafted["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == drafted["usage"]["completion_tokens"] == 40
    assert "".join(logprobs["tokens"]).startswith(drafted["choices"][0]["text"][:10])
    assert logprobs["tokens"] == plain["tokens"]
    assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(logprobs["token_logprobs"], plain["token_logprobs"]))
    for chosen, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        # (keyed by text, as OpenAI's: the tiny model's byte tokens that spell no character all read "\ufffd")
        assert 1 <= len(top) <= 2 and chosen <= 0 and max(top.values()) <= 0
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert completion(server)["choices"][0]["logprobs"] is None  # not asked for


def test_chat_and_llama_cpp_shapes(server):
    messages = [{"role": "user", "content": "count"}]
    chat = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0,
                                                     "logprobs": True, "top_logprobs": 3}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"} and len(content[0]["top_logprobs"]) == 3
    assert bytes(content[0]["bytes"]).decode("utf-8", "replace") == content[0]["token"]
    llama = server.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0, "n_probs": 2}).json()
    probabilities = llama["completion_probabilities"]
    assert len(probabilities) == llama["tokens_predicted"] and set(probabilities[0]) == {
        "id", "token", "logprob", "bytes", "top_logprobs"}
    for entry in probabilities:  # greedy: each token the likeliest, its log-probability the top one's
        assert entry["top_logprobs"][0]["id"] == entry["id"] and entry["top_logprobs"][0]["logprob"] == entry["logprob"]



def test_streams_carry_each_chunks_logprobs(server):
    """Each chunk (event) carries the log-probabilities of the tokens since the one before; together, the whole
    answer's, in every dialect."""
    def streamed(path: str, body: dict) -> list[dict]:
        with server.stream("POST", path, json=body | {"stream": True, "temperature": 0}) as response:
            return [event for event in sse_events(response) if event != "[DONE]"]

    whole = completion(server, logprobs=1, max_tokens=24)["choices"][0]["logprobs"]
    chunks = [e["choices"][0]["logprobs"] for e in streamed("/v1/completions", {"prompt": PROMPT, "max_tokens": 24,
                                                                                "logprobs": 1})]
    assert sum(bool(chunk["tokens"]) for chunk in chunks) > 2, "the log-probabilities came in one chunk"
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [value for chunk in chunks for value in chunk[key]] == whole[key], key
    messages = [{"role": "user", "content": "count"}]
    chat = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 16, "temperature": 0,
                                                     "logprobs": True}).json()["choices"][0]["logprobs"]["content"]
    parts = [e["choices"][0]["logprobs"]["content"] for e in streamed("/v1/chat/completions", {
        "messages": messages, "max_tokens": 16, "logprobs": True}) if e["choices"]]
    assert [entry for part in parts for entry in part] == chat and sum(bool(part) for part in parts) > 2
    llama = server.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0, "n_probs": 2}).json()
    events = streamed("/completion", {"prompt": PROMPT, "n_predict": 16, "n_probs": 2})
    assert [entry for e in events for entry in e["completion_probabilities"]] == llama["completion_probabilities"]


def test_top_logprobs_without_logprobs_is_a_400(server):
    answer = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "top_logprobs": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "top_logprobs"
