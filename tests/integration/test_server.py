"""`codespec serve` on the default model, as a user runs it: a subprocess on a loopback port, driven with httpx."""

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from codespec.config import SamplingParams
from codespec.context.fim import detect_fim, fim_prompt, trim_to_suffix
from tests.serving import running_codespec_serve, sse_events

pytestmark = pytest.mark.integration

PREFIX = "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
SUFFIX = "\n\ndef median(values):\n    ordered = sorted(values)\n"
EXTRA = [("stats/util.py", "def clamp(x, low, high):\n    return max(low, min(x, high))\n")]


@pytest.fixture(scope="module")
def server():
    with running_codespec_serve() as client:
        yield client


def metric(client, name):
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
               if line.startswith((name + "{", name + " ")))


def test_the_default_model_has_no_fim_tokens(default_engine):
    """SmolLM2-135M-Instruct: no <fim_*> tokens (prefix-only completion), but real <repo_name>/<file_sep> ones."""
    tokenizer = default_engine.tokenizer
    assert detect_fim(tokenizer) is None and "<fim_prefix>" not in tokenizer.get_vocab()
    prompt = fim_prompt(tokenizer, PREFIX, SUFFIX, extra=EXTRA, filename="stats/mean.py")
    assert prompt.format is None and prompt.ids[0] == tokenizer.convert_tokens_to_ids("<repo_name>")
    assert tokenizer.decode(prompt.ids).endswith("<file_sep>stats/mean.py\n" + PREFIX)


def test_completion_gives_the_same_text_as_the_cli(server):
    prompt = "# Python: reverse a string\ndef reverse(text):\n"
    cli = subprocess.run([sys.executable, "-m", "codespec", "generate", "--json", "--max-tokens", "32",
                          "--dtype", "float32", prompt], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout)
    body = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 32}).json()
    assert body["choices"][0]["text"] == expected["text"]
    assert body["usage"]["completion_tokens"] == len(expected["tokens"])
    with server.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 32, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == expected["text"]


def test_infill_is_the_engines_prefix_completion_cut_at_the_suffix(server, default_engine):
    request = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [
        {"filename": name, "text": text} for name, text in EXTRA], "filename": "stats/mean.py", "n_predict": 48}
    fim = fim_prompt(default_engine.tokenizer, PREFIX, SUFFIX, EXTRA, "stats/mean.py",
                     vocabulary=default_engine.vocabulary)  # /infill heals the cursor (PREFIX ends with a newline)
    assert fim.healed == "Ċ"
    plain = default_engine.generate(fim.ids, SamplingParams(max_tokens=48), healed=fim.healed).text
    body = server.post("/infill", json=request).json()
    assert body["content"] == trim_to_suffix(plain, SUFFIX)
    assert body["speculation"]["spec"] == ["ngram-mod", "prompt-lookup"]
    with server.stream("POST", "/infill", json=request | {"stream": True}) as r:
        events = sse_events(r)
    assert "".join(e["content"] for e in events) == body["content"] and events[-1]["stop"]


def test_warm_session_reuses_the_cache(server):
    warm = server.post("/infill", json={"input_prefix": PREFIX, "n_predict": 0, "session": "editor"}).json()
    body = server.post("/infill", json={"input_prefix": PREFIX, "prompt": "    return", "n_predict": 8,
                                        "session": "editor"}).json()
    assert warm["tokens_evaluated"] > 10 and body["tokens_cached"] >= warm["tokens_evaluated"] - 2
    assert body["timings"]["prompt_n"] <= body["tokens_evaluated"] - body["tokens_cached"]


def test_chat_streams_and_ends_with_done(server):
    request = {"messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}],
               "max_tokens": 24, "stream": True}
    with server.stream("POST", "/v1/chat/completions", json=request) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] > 0
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]).strip()


def test_sixteen_concurrent_clients_match_sequential_greedy(server, default_engine):
    prompts = [f"# {topic}\ndef {name}(" for topic, name in [
        ("sum a list", "total"), ("reverse a list", "backwards"), ("count words", "words"), ("is prime", "prime"),
        ("fibonacci", "fib"), ("factorial", "fact"), ("read a file", "read"), ("parse json", "parse")] * 2]
    expected = [default_engine.generate(p, SamplingParams(max_tokens=12)).text for p in prompts]

    def ask(index):
        request = {"prompt": prompts[index], "max_tokens": 12}
        if index % 2:
            return server.post("/v1/completions", json=request).json()["choices"][0]["text"]
        with server.stream("POST", "/v1/completions", json=request | {"stream": True}) as r:
            return "".join(e["choices"][0]["text"] for e in sse_events(r)[:-1])

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(ask, range(16))) == expected


def test_a_long_generation_does_not_block_a_short_one_and_a_disconnect_frees_it(server):
    long = {"prompt": "# A long module of Python utilities\n", "max_tokens": 2000, "stream": True, "session": "long"}
    with server.stream("POST", "/v1/completions", json=long) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        short = server.post("/infill", json={"input_prefix": "x = 1\ny = ", "n_predict": 4, "session": "short"})
        assert short.status_code == 200 and short.json()["tokens_predicted"] >= 1
        slots = {s["session"]: s for s in server.get("/slots").json()}
        assert slots["long"]["busy"], "the short request waited for the long one to finish"
    deadline = time.monotonic() + 60
    while {s["session"]: s for s in server.get("/slots").json()}["long"]["busy"]:
        assert time.monotonic() < deadline, "the disconnected generation kept running"
        time.sleep(0.1)
    assert metric(server, "codespec_cancelled_total") >= 1
    assert {s["session"]: s for s in server.get("/slots").json()}["long"]["tokens"] < 2000


def test_bad_input_never_takes_it_down(server):
    assert server.post("/v1/completions", json={"prompt": "word " * 9000}).status_code == 400  # over the context
    assert server.post("/infill", content=b"{", headers={"content-type": "application/json"}).status_code == 400
    assert server.post("/infill", json={"input_prefix": "x", "spec": "nope"}).status_code == 400
    assert server.get("/health").json() == {"status": "ok"}


def stdlib_prompts(count: int) -> list[str]:
    """Prompts of 150-300 tokens no test wrote: the first lines of standard-library functions, cut mid-body."""
    import inspect
    import json.decoder
    import shlex
    import statistics
    import textwrap

    functions = [textwrap.TextWrapper._wrap_chunks, json.decoder.py_scanstring, shlex.shlex.read_token,
                 statistics.linear_regression, textwrap.TextWrapper._split, statistics.median_grouped,
                 shlex.split, json.decoder.JSONObject, textwrap.dedent, statistics.correlation]
    return [inspect.getsource(f)[:700] for f in functions[:count]]


def test_eight_and_sixteen_concurrent_clients_get_the_one_client_texts_and_history_changes_nothing(server):
    """Under load the server splits prompts into other chunks and batches them with other sessions' rows, and a
    session reuses what it cached for an earlier request: with the default --invariant on, none of that changes a
    greedy text. 24 outputs of 8 concurrent clients (three rounds), 16 at once, and 8 prompts each sent to a
    session that served another prompt or the prompt's first half first, all against one client's texts in turn."""
    prompts = stdlib_prompts(8)

    def ask(prompt: str, session: str) -> str:
        request = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "session": session}
        response = server.post("/v1/completions", json=request, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    alone = [ask(p, f"alone-{i}") for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(8) as pool:
        loaded = [text for round_ in range(3) for text in pool.map(
            lambda i: ask(prompts[i], f"load-{round_}-{i}"), range(8))]
    assert sum(a == b for a, b in zip(loaded, alone * 3)) == 24
    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(lambda i: ask(prompts[i % 8], f"sixteen-{i}"), range(16))) == alone * 2
    for i, prompt in enumerate(prompts):  # first another prompt, or this one's first half (a cached prefix)
        ask(prompts[(i + 3) % 8] if i % 2 else prompt[: len(prompt) // 2], f"history-{i}")
        assert ask(prompt, f"history-{i}") == alone[i], i
