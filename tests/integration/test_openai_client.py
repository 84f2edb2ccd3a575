"""The official `openai` Python client (pinned in the test extras) against a real `codespec serve` on the default
model: completions and chat, streamed and not, with the client's optional parameters. Each either works or is a
4xx that the client raises as its typed error; never a 5xx."""

import openai
import pytest

from tests.serving import free_port, start_codespec_serve

pytestmark = pytest.mark.integration

PROMPT = "# Python: reverse a string\ndef reverse(text):\n"
MESSAGES = [{"role": "system", "content": "You write short Python functions."},
            {"role": "user", "content": "Write a function that reverses a string."}]


@pytest.fixture(scope="module")
def served():
    process, client = start_codespec_serve(free_port())
    yield str(client.base_url)
    client.close()
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct"
    assert client.models.retrieve(models[0].id).id == models[0].id
    return models[0].id


def test_completions_streamed_and_not(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert whole.choices[0].text.strip() and whole.usage.completion_tokens == 24
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_chat_streamed_and_not(client, model):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=32, temperature=0)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content.strip() and whole.usage.completion_tokens <= 32
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with client.chat.completions.stream(model=model, messages=MESSAGES, max_tokens=8, temperature=0) as helper:
        pieces = [event.delta for event in helper if event.type == "content.delta"]  # the client's stream helper
    assert "".join(pieces) and message.content.startswith("".join(pieces))


def test_a_zero_limit_only_warms_the_cache_streamed_or_not(client, model):
    """llama.cpp's n_predict 0 (max_tokens 0): the prompt goes into the cache, nothing is generated."""
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=0)
    assert whole.choices[0].message.content == "" and whole.usage.completion_tokens == 0
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens - 1  # warmed before
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=0).usage.completion_tokens == 0


def test_the_clients_optional_parameters_are_accepted(client, model):
    """Their neutral values, and the fields that only concern OpenAI's service."""
    common = dict(model=model, max_tokens=8, temperature=0.7, top_p=0.9, seed=1234, stop=["\n\n", "###"],
                  user="tester", n=1, presence_penalty=0, frequency_penalty=0, logit_bias={})
    chat = client.chat.completions.create(
        messages=MESSAGES, response_format={"type": "text"}, logprobs=False, store=False, metadata={"run": "test"},
        service_tier="auto", parallel_tool_calls=True, tool_choice="none", modalities=["text"],
        prediction={"type": "content", "content": "def reverse(text):"}, reasoning_effort="low",
        prompt_cache_key="tests", safety_identifier="tester", verbosity="low", **common)
    again = client.chat.completions.create(messages=MESSAGES, **common)
    assert chat.choices[0].message.content == again.choices[0].message.content  # seeded
    completion = client.completions.create(prompt=PROMPT, best_of=1, echo=False, suffix=None, **common)
    assert completion.choices[0].text == client.completions.create(prompt=PROMPT, **common).choices[0].text
    tokens = client.completions.create(model=model, prompt=[504, 28, 6829], max_tokens=4)  # token ids
    assert tokens.usage.prompt_tokens == 3


@pytest.mark.parametrize("route, options, error, param", [
    ("chat", {"model": "gpt-4o"}, openai.NotFoundError, "model"),
    ("completions", {"model": "gpt-3.5-turbo-instruct"}, openai.NotFoundError, "model"),
    ("chat", {"n": 9}, openai.UnprocessableEntityError, None),
    ("chat", {"top_logprobs": 2}, openai.BadRequestError, "top_logprobs"),  # (without logprobs: true)
    ("chat", {"presence_penalty": 0.5}, openai.BadRequestError, "presence_penalty"),
    ("chat", {"frequency_penalty": 1.0}, openai.BadRequestError, "frequency_penalty"),
    ("chat", {"logit_bias": {"99999999": 10}}, openai.BadRequestError, "logit_bias"),
    ("chat", {"response_format": {"type": "json_object"}}, openai.BadRequestError, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     openai.BadRequestError, "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "now", "parameters": {}}}]},
     openai.BadRequestError, "tools"),
    ("chat", {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
     openai.BadRequestError, "modalities"),
    ("chat", {"temperature": 3}, openai.UnprocessableEntityError, None),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     openai.UnprocessableEntityError, None),
    ("chat", {"messages": [{"role": "tool", "content": "42", "tool_call_id": "call_1"}]},
     openai.UnprocessableEntityError, None),
    ("completions", {"echo": True}, openai.BadRequestError, "echo"),
    ("completions", {"best_of": 3}, openai.UnprocessableEntityError, None),
    ("completions", {"prompt": ["one", "two"]}, openai.UnprocessableEntityError, None),
    ("completions", {"prompt": "word " * 9000}, openai.BadRequestError, None),  # over the context
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_it_cannot_do_is_a_typed_4xx(client, model, route, options, error, param, stream):
    if route == "chat":
        call, request = client.chat.completions.create, {"model": model, "messages": MESSAGES, "max_tokens": 4}
    else:
        call, request = client.completions.create, {"model": model, "prompt": PROMPT, "max_tokens": 4}
    with pytest.raises(error) as raised:
        call(**(request | options | ({"stream": True} if stream else {})))
    assert 400 <= raised.value.status_code < 500
    assert raised.value.body["message"]  # the client found the error's message in OpenAI's shape
    if param is not None:
        assert raised.value.body["param"] == param
    if error is openai.NotFoundError:
        assert raised.value.code == "model_not_found" and raised.value.type == "invalid_request_error"


def test_predicted_outputs_draft_the_answer_and_the_client_reads_their_counts(client, model):
    """OpenAI's `prediction` through the official client: the model's own earlier answer as the prediction is
    drafted whole (the text stays plain decoding's), and the usage counts the accepted prediction tokens."""
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=96, temperature=0,
                                           extra_body={"spec": "none"})
    answer = plain.choices[0].message.content
    predicted = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=96,
                                               temperature=0, prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 0.9 * predicted.usage.completion_tokens
    assert details.rejected_prediction_tokens <= 2
    assert predicted.model_extra["speculation"]["tokens_per_forward"] > 17  # drafts past draft_max (16): up to 64
    bounded = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=96, temperature=0,
                                             prediction={"type": "content", "content": answer},
                                             extra_body={"draft_max": 16})  # the request's own bound stands
    assert bounded.choices[0].message.content == answer
    assert 5 <= bounded.model_extra["speculation"]["tokens_per_forward"] <= 17
    wrong = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=96, temperature=0,
                                           prediction={"type": "content", "content": "SELECT * FROM users;\n" * 8})
    assert wrong.choices[0].message.content == answer
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0


def test_n_choices_come_from_one_prompt_and_stream_with_their_index(client, model):
    one = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=24, temperature=0)
    two = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=24, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.message.content == one.choices[0].message.content for c in two.choices)  # greedy: duplicates
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    sampled = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3, n=3,
                   extra_body={"spec": "none"})  # (drafts' lengths would follow what the pool learned before)
    chunks = list(client.completions.create(**sampled, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    whole = client.completions.create(**sampled)
    assert texts == [c.text for c in whole.choices] and len(set(texts)) > 1  # seeds one apart
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_logprobs_are_a_plain_decodes_at_every_position_with_and_without_speculation(client, model):
    """The default model's kernels give a verify forward's rows the bits of one-token forwards: each token's
    log-probability and its alternatives are exactly plain decoding's, drafts or not."""
    request = dict(model=model, messages=MESSAGES, max_completion_tokens=48, temperature=0, logprobs=True,
                   top_logprobs=3)
    plain = client.chat.completions.create(**request, extra_body={"spec": "none"})
    drafted = client.chat.completions.create(**request)
    assert drafted.model_extra["speculation"]["accepted_tokens"] > 0
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in drafted.choices[0].logprobs.content] == \
        [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in plain.choices[0].logprobs.content]
    assert len(plain.choices[0].logprobs.content) == plain.usage.completion_tokens
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    assert len(completion.choices[0].logprobs.tokens) == 8 and len(completion.choices[0].logprobs.top_logprobs[0]) <= 2
