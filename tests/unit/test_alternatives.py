"""Alternatives of one request (llama.cpp's n_cmpl) on the tiny model: the prompt computed once and copied, each
alternative what a request alone with its seed writes, streamed with its index."""

import json

import pytest

from tests.serving import sse_events, tiny_client

PROMPT = "def total(values):\n    result = 0\n    for value in values:\n"


@pytest.fixture
def server(engine):
    with tiny_client(engine) as client:
        yield client


def post(server, **body):
    answer = server.post("/completion", json={"prompt": PROMPT, "n_predict": 24, "cache_prompt": False, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_greedy_alternatives_are_one_answer_computed_once(server):
    alone = post(server, temperature=0)
    alternatives = post(server, temperature=0, n_cmpl=3)
    assert isinstance(alternatives, list) and [a["index"] for a in alternatives] == [0, 1, 2]
    assert all(a["content"] == alone["content"] for a in alternatives)
    assert all(a["timings"] == alternatives[0]["timings"] for a in alternatives)  # greedy: one run answers all


def test_sampled_alternatives_compute_the_prompt_once(server):
    alternatives = post(server, temperature=1.0, n_cmpl=3)
    prompt_tokens = alternatives[0]["tokens_evaluated"]
    assert alternatives[0]["timings"]["prompt_n"] == prompt_tokens  # the first computes the prompt
    for other in alternatives[1:]:  # the others copy its cache: only the prompt's last token is fed again
        assert other["tokens_cached"] == prompt_tokens - 1 and other["timings"]["prompt_n"] == 1


def test_sampled_alternatives_use_seeds_one_apart(server):
    """(Without drafts: a seeded sample consumes the random stream by the drafts' lengths, which follow what the
    shared pool learned from the requests before.)"""
    alternatives = post(server, temperature=1.0, seed=5, n_cmpl=3, spec="none")
    for index in range(3):
        assert alternatives[index]["content"] == post(server, temperature=1.0, seed=5 + index, spec="none")["content"]
    assert len({a["content"] for a in alternatives}) > 1


def test_streamed_alternatives_tag_each_event_with_its_index(server):
    whole = post(server, temperature=1.0, seed=11, n_cmpl=2, spec="none")
    body = {"prompt": PROMPT, "n_predict": 24, "cache_prompt": False, "temperature": 1.0, "seed": 11, "n_cmpl": 2,
            "stream": True, "spec": "none"}
    with server.stream("POST", "/completion", json=body) as response:
        events = sse_events(response)
    pieces = {0: "", 1: ""}
    for event in events:
        pieces[event["index"]] += event["content"]
    assert pieces == {0: whole[0]["content"], 1: whole[1]["content"]}
    assert sum(1 for event in events if event["stop"]) == 2


def test_too_many_alternatives_is_a_400(server):
    answer = server.post("/infill", json={"input_prefix": "x = ", "n_predict": 4, "n_cmpl": 9})
    assert answer.status_code == 400 and "n_cmpl" in json.dumps(answer.json())


def test_streamed_greedy_alternatives_are_one_stream_under_each_index(server):
    whole = post(server, temperature=0)
    body = {"prompt": PROMPT, "n_predict": 24, "cache_prompt": False, "temperature": 0, "n_cmpl": 3, "stream": True}
    with server.stream("POST", "/completion", json=body) as response:
        events = sse_events(response)
    pieces = {0: "", 1: "", 2: ""}
    for event in events:
        pieces[event["index"]] += event["content"]
    assert pieces == {0: whole["content"], 1: whole["content"], 2: whole["content"]}
    assert sorted(event["index"] for event in events if event["stop"]) == [0, 1, 2]


def test_alternatives_read_the_prompts_keys_from_one_copy_and_write_what_each_seed_writes_alone(monkeypatch):
    """float32 on the CPU (the attention kernel's path), a prompt of some 200 tokens: the other alternatives read the
    copied prompt's keys and values from the first one's cache (`StaticCache.shared_prefix`) and write, seed by seed,
    the text a request alone writes from its own cache."""
    import torch

    from codespec.config import SpecConfig
    from codespec.engine import Engine
    from codespec.forward.kernels import attention
    from tests.tiny import EOS, tiny_model, tiny_tokenizer

    engine = Engine(tiny_model(dtype=torch.float32), tiny_tokenizer(), SpecConfig(), eos_token_ids=frozenset({EOS}))
    shared = []
    original = attention.make_table
    monkeypatch.setattr(attention, "make_table", lambda *args: shared.append(original(*args)[:, 11].max().item())
                        or original(*args))
    body = {"prompt": PROMPT * 10, "n_predict": 24, "cache_prompt": False, "temperature": 1.0, "spec": "none",
            "n_probs": 2}  # (the tiny model's text hardly depends on attention; its probabilities' bits do)
    with tiny_client(engine) as client:
        together = client.post("/completion", json={**body, "seed": 5, "n_cmpl": 3}).json()
        assert max(shared) >= 160  # the alternatives past the first read the prompt's keys from its cache
        shared.clear()
        for index in range(3):
            alone = client.post("/completion", json={**body, "seed": 5 + index}).json()
            assert together[index]["content"] == alone["content"]
            assert together[index]["completion_probabilities"] == alone["completion_probabilities"]
        assert max(shared) == 0
