"""HTTP fuzzing of `codespec serve`: schemathesis over every route, then hand-made hostile requests, then 50
mid-stream disconnects in a row; a normal greedy request before and after must give the same text.

- schemathesis (property-based, from the server's own OpenAPI document): schema-valid and schema-violating
  requests for every route, with its checks: no 5xx, status codes, content types, headers and bodies as
  documented, invalid data refused, 405 with Allow for methods a route lacks. Off: positive_data_acceptance,
  since the schema cannot say that a prompt must fit the model's context or that a temperature is 0 or >= 0.001
  (such requests get a documented 400).
- hostile requests: invalid UTF-8, lone surrogates, NUL, deep nesting, bodies over 4 MB (declared and chunked),
  thousands of stop strings or input_extra chunks, stalled headers and bodies, a foreign Host or Origin, NaN;
  each must get its expected status (never a 5xx) in time.

Run it as `python -m codespec.bench.fuzz_http` (a fresh `codespec serve` on a tiny random model with the default
model's tokenizer, so each generation is quick and FIM tokens and the chat template are real), or against a running
server with --url. Prints a JSON report; exits 1 when anything returned a 5xx, hung, failed a check or changed the
greedy text.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import httpx

REQUEST_TIMEOUT = 60.0  # seconds before a request counts as hung
GREEDY = {"prompt": "def fibonacci(n):\n    if n < 2:\n        return n\n", "max_tokens": 24, "temperature": 0.0}
CHECKS_OFF = ("positive_data_acceptance",)  # see the module docstring
# invalid data may also be refused for its size (413: a generated body past the 4 MB limit) or for being too slow
# to arrive (408), besides schemathesis's own list of rejections
REJECTIONS = ["400", "401", "403", "404", "406", "408", "413", "422", "428", "5xx"]


def fuzz_schema(url: str, examples: int, seed: int = 0, max_seconds: float | None = None,
                phases: tuple[str, ...] = ("examples", "coverage", "fuzzing")) -> dict:
    """schemathesis's `phases` over every operation of the server's OpenAPI document; `examples`: hypothesis
    examples per operation in the fuzzing phase (the coverage phase's boundary cases are as many as the schema
    has)."""
    import schemathesis
    from schemathesis.engine import events, from_schema

    settings = {"seed": seed, "request-timeout": REQUEST_TIMEOUT,
                "generation": {"max-examples": examples, "mode": "all"},
                "checks": {"enabled": True, **{name: {"enabled": False} for name in CHECKS_OFF},
                           "negative_data_rejection": {"expected-statuses": REJECTIONS}},
                "phases": {name: {"enabled": name in phases} for name in ("examples", "coverage", "fuzzing",
                                                                          "stateful")}}
    if max_seconds:
        settings["max-time"] = max_seconds
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=schemathesis.Config.from_dict(settings))
    report = {"requests": Counter(), "statuses": Counter(), "server_errors": [], "hangs": [], "failures": [],
              "errors": []}

    @schema.hook("after_call")
    def count(context, case, response):
        route = f"{case.method} {case.path}"
        report["requests"][route] += 1
        report["statuses"][response.status_code] += 1
        if response.status_code >= 500:
            report["server_errors"].append(f"{route} -> {response.status_code}: {case.as_curl_command()}")

    @schema.hook("after_network_error")
    def lost(context, case, request):
        report["hangs"].append(f"{case.method} {case.path}: {case.as_curl_command()}")

    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.status.name != "SUCCESS" and check.failure_info is not None:
                        failure = check.failure_info.failure
                        report["failures"].append(f"{event.recorder.label} {check.name}: {failure.title}: "
                                                  f"{failure.message[:300]} ({check.failure_info.code_sample})")
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            report["errors"].append(str(getattr(event, "value", None) or getattr(event, "exception", event)))
        elif isinstance(event, events.EngineFinished):
            report["stop_reason"] = str(event.stop_reason)  # "completed", or "max_time" when --max-seconds ran out
    report["failures"] = sorted(set(report["failures"]))
    return report


# -- hand-made hostile requests ------------------------------------------------------------------------------------


def post(url: str, path: str, body, headers: dict | None = None) -> httpx.Response:
    """A POST on a fresh connection (some answers close theirs); bytes are sent as they are, as JSON."""
    headers = {"content-type": "application/json", **(headers or {})}
    content = body if isinstance(body, bytes) or not isinstance(body, dict | list) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers=headers, timeout=REQUEST_TIMEOUT)


def chunked(total: int, size: int = 1 << 20):
    while total > 0:
        yield b" " * min(size, total)
        total -= size


def raw(url: str, data: bytes, wait: float) -> str:
    """Sends raw bytes and reads until the server closes: its status line, or 'closed' with no answer."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.settimeout(wait)
        try:
            sock.sendall(data)
        except OSError:  # the server stopped reading (and answered) before the end
            pass
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except TimeoutError:
            return "hung"
        except ConnectionResetError:  # closed with our bytes unread: the answer may be lost
            return answer.split(b"\r\n", 1)[0].decode("latin-1") if answer else "reset"
    return answer.split(b"\r\n", 1)[0].decode("latin-1") if answer else "closed"


def hostile_cases(url: str, read_timeout: float) -> list[tuple[str, object, object]]:
    """(name, the expected status or answer (or a tuple of them), a function that makes the request and returns
    its status or answer)."""
    nested = lambda depth: b"[" * depth + b"]" * depth  # noqa: E731
    big = b'{"prompt": "' + b"x" * (4 << 20) + b'"}'
    port = urlsplit(url).port
    stall_wait = read_timeout + 10
    cases = [
        ("invalid UTF-8", 400, lambda: post(url, "/v1/completions", b'{"prompt": "a\xff\xfeb"}')),
        # llama.cpp's routes answer an invalid body with llama-server's 400, OpenAI's with 422
        ("U+D800 as raw bytes ED A0 80", 400, lambda: post(url, "/infill", b'{"input_prefix": "a\xed\xa0\x80"}')),
        ("lone surrogate in input_prefix", 400, lambda: post(url, "/infill", b'{"input_prefix": "\\ud800"}')),
        ("lone surrogate in input_extra", 400,
         lambda: post(url, "/infill", b'{"input_prefix": "x", "input_extra": [{"text": "\\udfff"}]}')),
        ("lone surrogate in a completion prompt", 422, lambda: post(url, "/v1/completions", b'{"prompt": "\\ud800"}')),
        ("lone surrogate in chat content", 422, lambda: post(
            url, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}')),
        ("lone surrogate in a stop string", 422,
         lambda: post(url, "/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}')),
        ("NUL in a prompt", 200, lambda: post(url, "/v1/completions", {"prompt": "a\x00b\x00", "max_tokens": 4})),
        ("100,000 nested arrays", 400, lambda: post(url, "/infill", nested(100_000))),
        ("50,000 nested objects", 400,
         lambda: post(url, "/infill", b'{"a": ' * 50_000 + b"1" + b"}" * 50_000)),
        ("nested arrays in a field", 422, lambda: post(url, "/v1/completions", b'{"prompt": ' + nested(500) + b"}")),
        ("4 MB+ body, declared", 413, lambda: post(url, "/v1/completions", big)),
        ("4 MB+ body, chunked", 413, lambda: post(url, "/infill", chunked((4 << 20) + 1))),
        ("a 3.9 MB prompt", 400, lambda: post(url, "/v1/completions", {"prompt": "word " * 780_000})),
        ("a 3.9 MB infill prefix (cut to fit the context)", 200,
         lambda: post(url, "/infill", {"input_prefix": "value = 1; " * 350_000, "n_predict": 4})),
        ("5,000 stop strings", 422, lambda: post(url, "/v1/completions", {"prompt": "x", "stop": ["s"] * 5000})),
        ("1,024 input_extra chunks", 200, lambda: post(url, "/infill", {
            "input_prefix": "x", "n_predict": 4,
            "input_extra": [{"filename": f"f{i}.py", "text": f"value_{i} = {i}\n" * 20} for i in range(1024)]})),
        ("5,000 input_extra chunks", 400, lambda: post(url, "/infill", {
            "input_prefix": "x", "input_extra": [{"text": "y"}] * 5000})),
        ("temperature 1e-39", 400, lambda: post(url, "/infill", {"input_prefix": "x", "temperature": 1e-39})),
        ("top_p 5e-324", 422, lambda: post(url, "/v1/completions", {"prompt": "x", "top_p": 5e-324})),
        ("NaN temperature", 422, lambda: post(url, "/v1/completions", b'{"prompt": "x", "temperature": NaN}')),
        ("Infinity max_tokens", 422, lambda: post(url, "/v1/completions", b'{"prompt": "x", "max_tokens": Infinity}')),
        ("a 400-digit n_predict", 400, lambda: post(url, "/infill", b'{"n_predict": 1' + b"0" * 400 + b"}")),
        ("body null", 400, lambda: post(url, "/infill", b"null")),
        ("lone surrogate to /tokenize", 400, lambda: post(url, "/tokenize", b'{"content": "\\udc00"}')),
        ("a token id past the vocabulary to /detokenize", 400,
         lambda: post(url, "/detokenize", {"tokens": [1, 2, 2_000_000_000]})),
        ("a 3.9 MB text to /tokenize", 200, lambda: post(url, "/tokenize", {"content": "word " * 780_000})),
        ("a 3.9 MB prompt to /completion", 400, lambda: post(url, "/completion", {"prompt": "word " * 780_000})),
        ("body a string", 422, lambda: post(url, "/v1/chat/completions", b'"hello"')),
        ("empty body", 422, lambda: post(url, "/v1/completions", b"")),
        ("text/plain from another origin", 403, lambda: post(url, "/v1/completions", {"prompt": "x"}, {
            "content-type": "text/plain", "origin": "https://attacker.example"})),
        ("a form post from another origin", 403, lambda: post(url, "/infill", b"input_prefix=x", {
            "content-type": "application/x-www-form-urlencoded", "origin": "null"})),
        ("text/plain without an origin", 415,
         lambda: post(url, "/v1/completions", {"prompt": "x"}, {"content-type": "text/plain"})),
        ("DNS rebinding: a foreign Host", 403,
         lambda: httpx.get(url + "/slots", headers={"host": f"attacker.example:{port}"})),
        ("PUT /infill", 405, lambda: httpx.put(url + "/infill", json={})),
        ("a 1 MB header", ("HTTP/1.1 400 Bad Request", "reset"), lambda: raw(  # h11 buffers 16 KB of unfinished headers
            url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n", 10)),
        ("stalled headers", "closed", lambda: raw(url, b"POST /infill HTTP/1.1\r\nHost: 127.0.0.1\r\n", stall_wait)),
        ("a stalled body", "HTTP/1.1 408 Request Timeout", lambda: raw(
            url, b"POST /infill HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"input_prefix\": ", stall_wait)),
    ]
    return cases


def hostile_requests(url: str, read_timeout: float) -> list[dict]:
    """Each hostile case's name, expected and actual answer, and seconds; `ok` when they agree."""
    outcomes = []
    for name, expected, request in hostile_cases(url, read_timeout):
        started = time.perf_counter()
        try:
            answer = request()
            answer = answer.status_code if isinstance(answer, httpx.Response) else answer
        except httpx.TimeoutException:
            answer = "hung"
        except httpx.TransportError as exc:
            answer = f"connection error: {exc!r}"
        ok = answer in expected if isinstance(expected, tuple) else answer == expected
        outcomes.append({"name": name, "expected": expected, "answer": answer, "ok": ok,
                         "seconds": round(time.perf_counter() - started, 2)})
    return outcomes


def disconnects(url: str, count: int = 50) -> int:
    """`count` streamed completions in a row, each dropped after its first event; returns how many started."""
    started = 0
    for index in range(count):
        path, body = [("/v1/completions", {"prompt": "import os\n", "max_tokens": 200}),
                      ("/infill", {"input_prefix": "def f(x):\n", "n_predict": 200}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200})
                      ][index % 3]
        with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=REQUEST_TIMEOUT) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    started += 1
                    break
    return started


def greedy_text(url: str) -> str:
    response = httpx.post(url + "/v1/completions", json=GREEDY, timeout=REQUEST_TIMEOUT)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def fuzz(url: str, examples: int, read_timeout: float, seed: int = 0, max_seconds: float | None = None) -> dict:
    """The whole run against the server at `url`: the report, with `ok`."""
    before = greedy_text(url)
    started = time.perf_counter()
    schema = fuzz_schema(url, examples, seed, max_seconds)
    hostile = hostile_requests(url, read_timeout)
    dropped = disconnects(url)
    after = greedy_text(url)
    report = {"seconds": round(time.perf_counter() - started, 1), "schemathesis": schema,
              "schemathesis_requests": sum(schema["requests"].values()),
              "routes": len({route.split()[1] for route in schema["requests"]}),
              "hostile": hostile, "hostile_failed": [case for case in hostile if not case["ok"]],
              "disconnects_started": dropped, "greedy_unchanged": before == after}
    report["ok"] = (not schema["server_errors"] and not schema["hangs"] and not schema["failures"]
                    and not schema["errors"] and not report["hostile_failed"] and dropped == 50
                    and report["greedy_unchanged"])
    return report


def tiny_checkpoint(folder: Path) -> Path:
    """A tiny randomly initialised Llama with the default model's tokenizer (its FIM tokens and chat template)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ..forward.models import pull

    tokenizer = AutoTokenizer.from_pretrained(pull(show_progress=False))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codespec.bench.fuzz_http", description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="fuzz this running server (started with --read-timeout as given here)")
    parser.add_argument("--model", help="serve this model instead of a tiny random one")
    parser.add_argument("--examples", type=int, default=100, help="schemathesis examples per route and phase")
    parser.add_argument("--max-seconds", type=float, default=240, help="schemathesis's time limit (default 240)")
    parser.add_argument("--read-timeout", type=float, default=3.0, help="the server's --read-timeout (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results/fuzz-http.json")
    args = parser.parse_args(argv)

    from .server_load import serve

    with tempfile.TemporaryDirectory() as folder:
        model = args.model or (None if args.url else str(tiny_checkpoint(Path(folder))))
        serve_args = ["--read-timeout", str(args.read_timeout), "--dtype", "float32"]
        if model:
            serve_args += ["--model", model]
        with serve(args.url, serve_args) as client:
            report = fuzz(str(client.base_url).rstrip("/"), args.examples, args.read_timeout, args.seed,
                          args.max_seconds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    summary = {key: report[key] for key in ("ok", "seconds", "schemathesis_requests", "routes",
                                            "disconnects_started", "greedy_unchanged")}
    summary["stop_reason"] = report["schemathesis"].get("stop_reason")
    summary.update(server_errors=len(report["schemathesis"]["server_errors"]),
                   hangs=len(report["schemathesis"]["hangs"]), check_failures=report["schemathesis"]["failures"],
                   statuses=dict(report["schemathesis"]["statuses"]), hostile=len(report["hostile"]),
                   hostile_failed=report["hostile_failed"])
    print(json.dumps(summary, indent=1, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
