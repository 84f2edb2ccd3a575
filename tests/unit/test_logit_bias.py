"""logit_bias on the tiny model, in both dialects (OpenAI's {"id": bias}, llama.cpp's [[id or text, bias or false]]):
the answer is the biased model's, token for token the same with and without drafts, and a bad one is a 4xx."""

from dataclasses import replace

import pytest

from tests.serving import tiny_client

PROMPT = "def total(values):\n    result = 0\n    for value in values:\n" * 3  # repetitive: drafts get accepted


@pytest.fixture
def server(engine):
    engine.spec = replace(engine.spec, adaptive=False)  # drafts verified whatever this machine's load
    with tiny_client(engine) as client:
        yield client


def completion(server, **body) -> dict:
    answer = server.post("/completion", json={"prompt": PROMPT, "n_predict": 24, "temperature": 0,
                                              "return_tokens": True, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_banned_token_never_comes_and_drafts_change_nothing(server):
    plain = completion(server, spec="none")
    banned = max(set(plain["tokens"]), key=plain["tokens"].count)  # the answer's most frequent token
    llama = completion(server, logit_bias=[[banned, False]])
    assert banned not in llama["tokens"] and llama["tokens"] != plain["tokens"]
    assert llama["speculation"]["accepted_tokens"] > 0, "no draft was accepted: nothing was compared"
    assert completion(server, logit_bias=[[banned, False]], spec="none")["tokens"] == llama["tokens"]
    assert llama["generation_settings"]["logit_bias"] == [{"token": banned, "bias": None}]
    openai = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                  "logit_bias": {str(banned): -100}}).json()
    assert openai["choices"][0]["text"] == llama["content"]


def test_a_large_bias_all_but_forces_a_token_greedy_or_sampled(server):
    for temperature in (0, 1.0):
        forced = completion(server, logit_bias={"7": 100}, temperature=temperature, seed=3)
        assert forced["tokens"] == [7] * 24, temperature


def test_a_text_key_biases_each_of_its_tokens(server):
    plain = completion(server, spec="none")
    first = server.post("/detokenize", json={"tokens": plain["tokens"][:1]}).json()["content"]
    tokens = server.post("/tokenize", json={"content": first}).json()["tokens"]
    biased = completion(server, logit_bias=[[first, False]])
    assert not set(tokens) & set(biased["tokens"])
    assert {entry["token"] for entry in biased["generation_settings"]["logit_bias"]} == set(tokens)


@pytest.mark.parametrize("path, bias, status", [
    ("/completion", [[4200000, 1.0]], 400),  # outside the vocabulary
    ("/v1/completions", {"4200000": 1.0}, 400),
    ("/completion", [[1]], 400),  # not a pair (llama.cpp's routes answer 400 for a malformed body)
    ("/v1/completions", {"1": 101e6}, 422),  # out of range
    ("/v1/completions", {str(i): 1.0 for i in range(1025)}, 422),  # too many
])
def test_a_bad_logit_bias_is_a_4xx_and_the_server_goes_on(server, path, bias, status):
    answer = server.post(path, json={"prompt": PROMPT, "max_tokens": 2, "logit_bias": bias})
    assert answer.status_code == status, answer.text
    assert "logit_bias" in answer.text
    assert completion(server)["tokens_predicted"] == 24
