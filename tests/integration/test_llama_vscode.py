"""llama.vscode against a real `codespec serve` on the default model, with llama.vscode's own request shapes.

The bodies mirror ggml-org/llama.vscode v0.0.63 (commit 3938fb3), src/llama-server.ts: createRequestPayload's FIM
request to `${endpoint}/infill` (with `n_cmpl: max_parallel_completions`, default 3) and its cache warm-up
(`n_predict: 0`), countTextTokens' /tokenize, applyToolsTemplate's /apply-template, getToolsModelTokenLimits'
/v1/models then /props (when the model looks like llama.cpp's: `owned_by` 'llamacpp' or a `meta` object), and
createChatEditRequestPayload's /v1/chat/completions. Its defaults (src/configuration.ts): n_predict 128,
t_max_prompt_ms 500, t_max_predict_ms 2500, ai_api_version 'v1'. What it reads back is what src/completion.ts'
getComplFromContent and language-model-token-limits.ts' extractRuntimeContextSize read.
"""

import pytest

from tests.serving import running_codespec_serve

pytestmark = pytest.mark.integration

DEFAULTS = {"top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True}  # llama.vscode's defaultRequestParams
CHUNKS = [{"text": "def mean(values):\n    return sum(values) / len(values)\n", "time": 1763900000,
           "filename": "stats.py"}]
PREFIX = "import math\n\n\ndef variance(values):\n    m = mean(values)\n"
SUFFIX = "\n\ndef stdev(values):\n    return math.sqrt(variance(values))\n"
CHAT_EDIT_TEXT = ("Modify the following original code according to the instructions. Output only the modified code. "
                  "No explanations.\n\ninstructions:\n{instructions}\n\noriginal code:\n{originalText}\n\n"
                  "modified code:")  # src/prompts.ts


@pytest.fixture(scope="module")
def server():
    with running_codespec_serve() as client:
        yield client


def completions_of(data) -> list[str]:
    """getComplFromContent: one answer's content, or each of an array's, without repeats."""
    if isinstance(data, dict) and "content" in data:
        return [data["content"] or ""]
    return list(dict.fromkeys(item.get("content") or "" for item in data))


def test_fim_with_its_warm_up_and_n_cmpl(server):
    warm = server.post("/infill", json={"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": CHUNKS,
                                        "prompt": "", "n_predict": 0, "samplers": [], "cache_prompt": True,
                                        "t_max_prompt_ms": 500, "t_max_predict_ms": 1})
    assert warm.status_code == 200, warm.text
    answer = server.post("/infill", json={"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX,
                                          "input_extra": CHUNKS, "prompt": "    ", "n_predict": 128, "n_cmpl": 3,
                                          **DEFAULTS, "n_indent": 4, "t_max_prompt_ms": 500,
                                          "t_max_predict_ms": 2500})
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert isinstance(data, list) and [item["index"] for item in data] == [0, 1, 2]  # as llama-server answers
    suggestions = completions_of(data)
    assert suggestions and all(isinstance(text, str) for text in suggestions)
    for item in data:  # what its status bar reads of an answer
        assert item["timings"]["predicted_n"] >= 1 and item["generation_settings"]["n_ctx"] > 0
        assert isinstance(item["tokens_cached"], int)


def test_token_counting_through_apply_template_and_tokenize(server):
    messages = [{"role": "system", "content": "You are an expert coder."},
                {"role": "user", "content": "Add a docstring to mean()."}]
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                               "parameters": {"type": "object", "properties": {}}}}]
    template = server.post("/apply-template", json={"messages": messages, "tools": tools, "tool_choice": "auto"})
    assert template.status_code == 200, template.text
    prompt = template.json()["prompt"]
    assert "Add a docstring to mean()." in prompt
    counted = server.post("/tokenize", json={"content": prompt, "add_special": False, "parse_special": True})
    assert counted.status_code == 200, counted.text
    tokens = counted.json()["tokens"]
    assert len(tokens) > 10 and all(isinstance(token, int) for token in tokens)
    plain = server.post("/apply-template", json={"messages": messages}).json()["prompt"]
    counted = server.post("/tokenize", json={"content": plain, "add_special": False, "parse_special": True})
    chat = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "temperature": 0})
    assert chat.json()["usage"]["prompt_tokens"] == len(counted.json()["tokens"])  # what it budgets with is exact


def test_context_size_from_models_then_props(server):
    models = server.get("/v1/models").json()["data"]
    assert len(models) == 1
    model = models[0]
    assert model.get("owned_by", "").lower() == "llamacpp" or isinstance(model.get("meta"), dict)  # llama.cpp-like
    props = server.get("/props").json()
    n_ctx = props["default_generation_settings"]["n_ctx"]
    assert isinstance(n_ctx, int) and n_ctx == model["meta"]["context_length"] > 0


def test_chat_edit(server):
    original = "def mean(values):\n    return sum(values) / len(values)\n"
    body = {"messages": [{"role": "system", "content": "You are an expert coder."},
                         {"role": "user", "content": CHAT_EDIT_TEXT.format(instructions="add type hints",
                                                                            originalText=original)}],
            "stream": False, "cache_prompt": True, "temperature": 0.8, "top_p": 0.95,
            "max_tokens": 64}  # (llama.vscode sets no limit: the context's end would be this test's)
    answer = server.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"].strip()
