"""OpenAI's Predicted Outputs (`prediction`) on every generation route, on the tiny model: the prediction drafts
(edit-align follows it), the text stays what the model writes, and usage counts the prediction's tokens."""

import pytest

from tests.serving import sse_events, tiny_client

PROMPT = "def total(values):\n    result = 0\n    for value in values:\n"


@pytest.fixture
def server(engine):
    with tiny_client(engine) as client:
        yield client


def completion(server, route: str, prediction=None, **more) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "cache_prompt": False, **more}
    if route == "/completion":
        body = {**body, "n_predict": body.pop("max_tokens")}
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    answer = server.post(route, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def text_of(route: str, body: dict) -> str:
    return body["choices"][0]["text"] if route == "/v1/completions" else body["content"]


def edit_align(body: dict) -> dict:
    return next((d for d in body["speculation"]["drafters"] if d["name"] == "edit-align"), {})


@pytest.mark.parametrize("route", ["/v1/completions", "/completion"])
def test_the_output_as_its_own_prediction_is_drafted_and_the_text_does_not_change(server, route):
    """(The tiny model writes byte-level tokens that its text encodes otherwise: the prediction's tokens match the
    output only after edit-align re-finds its place; the default model's rewrite: tests/integration.)"""
    plain = completion(server, route, spec="none")
    text = text_of(route, plain)
    assert len(text) > 20
    predicted = completion(server, route, prediction=text)
    assert text_of(route, predicted) == text
    drafts = edit_align(predicted)
    assert drafts["acc_tokens"] >= 4
    assert predicted["speculation"]["target_forwards"] < plain["speculation"]["target_forwards"]
    if route == "/v1/completions":
        details = predicted["usage"]["completion_tokens_details"]
        assert details == {"accepted_prediction_tokens": drafts["acc_tokens"],
                           "rejected_prediction_tokens": drafts["gen_tokens"] - drafts["acc_tokens"]}
        assert plain["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 0,
                                                              "rejected_prediction_tokens": 0}


def test_a_prediction_that_is_wrong_drafts_but_never_changes_the_text(server):
    plain = completion(server, "/v1/completions", spec="none")
    wrong = completion(server, "/v1/completions", prediction="while True:\n    pass\n" * 20)
    assert wrong["choices"][0]["text"] == plain["choices"][0]["text"]
    details = wrong["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == edit_align(
        wrong)["gen_tokens"]


def test_a_prediction_on_chat_infill_and_streams_keeps_the_text_and_counts_in_the_last_chunk(server):
    messages = [{"role": "user", "content": "Rewrite: x = 1"}]
    plain = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 24, "temperature": 0,
                                                       "spec": "none"}).json()
    said = plain["choices"][0]["message"]["content"]
    with server.stream("POST", "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "prediction": {"type": "content", "content": [{"type": "text", "text": said}]}}) as response:
        events = sse_events(response)[:-1]  # (the last is [DONE])
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
    assert streamed == said
    assert events[-1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] >= 1
    infill = {"input_prefix": "def f(x):\n    ", "input_suffix": "\n    return y\n", "n_predict": 16,
              "temperature": 0}
    first = server.post("/infill", json={**infill, "spec": "none"}).json()["content"]
    again = server.post("/infill", json={**infill, "prediction": {"type": "content", "content": first}}).json()
    assert again["content"] == first


@pytest.mark.parametrize("prediction", [{"type": "image", "content": "x"}, {"type": "content"},
                                        {"type": "content", "content": 5}, "just text"])
def test_a_malformed_prediction_is_a_4xx_with_an_error(server, prediction):
    answer = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "prediction": prediction})
    assert 400 <= answer.status_code < 500 and "error" in answer.json()


def test_a_request_s_own_draft_max_bounds_its_prediction_s_drafts(server):
    """A prediction drafts up to --prediction-draft-max tokens a step (64), unless the request sets draft_max."""
    text = text_of("/completion", completion(server, "/completion", spec="none"))
    bounded = completion(server, "/completion", prediction=text, draft_max=2)
    assert bounded["content"] == text
    assert 0 < edit_align(bounded)["gen_tokens"] <= 2 * bounded["speculation"]["target_forwards"]
