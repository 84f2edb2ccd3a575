"""The thin language server's HTTP backend (lsp/remote.py) against httpx's mock transport: what it sends, how it
reads server-sent events, and how each server failure becomes a JSON-RPC error or an empty completion."""

import json
from contextlib import aclosing

import httpx
import pytest
from pygls.exceptions import JsonRpcException

from codespec.cli.options import build_parser
from codespec.context.fim import SuffixTrimmer
from codespec.request import BlockLimit
from lsp.backend import InfillRequest, RewriteRequest, Unavailable
from lsp.fim_prompts import InfillPrompts
from lsp.remote import RemoteBackend, sse_data
from lsp.settings import spec_config
from lsp.protocol import REWRITE_SELECTION, Settings

URL = "http://codespec.test:8012"


def events(*datas, done=False) -> bytes:
    body = "".join(f"data: {json.dumps(data)}\n\n" for data in datas)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def backend(handler, api_key="k") -> tuple[RemoteBackend, list[httpx.Request]]:
    seen = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    remote = RemoteBackend(URL, InfillPrompts(Settings), api_key, transport=httpx.MockTransport(record))
    return remote, seen


def infill_request(session="lsp:file:///w/a.py") -> InfillRequest:
    kept = [("other.py", "def helper():\n    pass\n")]  # the other files' chunks picked for an earlier keystroke
    return InfillRequest(session, "file:///w/a.py", "def f(x):\n    return ", "\n", (), [], (), kept, "", [], 16,
                         ("\n",), spec_config(Settings()))


def rewrite_request() -> RewriteRequest:
    return RewriteRequest("lsp-command:file:///w/a.py", REWRITE_SELECTION.id, {"instruction": "rename x to y"},
                          "def f(x):\n    return x\n", "python", 64, spec_config(Settings(), command=True))


async def collect(generation) -> list:
    async with aclosing(generation) as pieces:
        return [piece async for piece in pieces]


LAST_INFILL = {"content": "", "stop": True, "tokens_predicted": 3, "tokens_evaluated": 40, "tokens_cached": 35,
               "timings": {"prompt_ms": 12.0, "predicted_ms": 30.0},
               "speculation": {"target_forwards": 2, "drafted_tokens": 4, "accepted_tokens": 1}}


@pytest.mark.asyncio
async def test_a_completion_sends_the_prompt_parts_and_streams_the_pieces():
    remote, seen = backend(lambda request: httpx.Response(200, content=events(
        {"content": "x", "stop": False}, {"content": " + 1", "stop": False}, LAST_INFILL),
        headers={"content-type": "text/event-stream"}))
    pieces = await collect(remote.infill(infill_request()))
    assert "".join(piece.text for piece in pieces) == "x + 1"
    assert pieces[-1].final and not any(piece.final for piece in pieces[:-1])
    stats = pieces[-1].stats
    assert (stats.prompt_tokens, stats.cached_tokens, stats.generated_tokens) == (40, 35, 3)
    assert stats.acceptance_rate == 0.25 and stats.seconds == pytest.approx(0.042)

    (request,) = seen
    body = json.loads(request.content)
    assert request.url.path == "/infill" and request.headers["authorization"] == "Bearer k"
    assert body["input_prefix"] == "def f(x):\n    return " and body["input_suffix"] == "\n"
    assert body["input_extra"] == [{"filename": "other.py", "text": "def helper():\n    pass\n"}]
    assert body["filename"] == "a.py" and body["n_predict"] == 16 and body["stop"] == ["\n"] and body["stream"]
    assert body["session"] == request.headers["x-session-id"] == remote.session_name("lsp:file:///w/a.py")


@pytest.mark.asyncio
async def test_the_editor_s_limits_end_a_remote_completion_as_they_end_a_local_one():
    """The server knows n_predict and the stop strings; the block's end and the suffix are the language server's,
    applied to the stream by the request layer's output filter, which stops reading at the cut."""
    remote, _ = backend(lambda request: httpx.Response(200, content=events(
        {"content": "x = 1\n", "stop": False}, {"content": "    y = 2\n\n", "stop": False},
        {"content": "    return y\nprint(f(2))\n", "stop": False}, LAST_INFILL),
        headers={"content-type": "text/event-stream"}))
    request = infill_request()
    request.limits = [SuffixTrimmer("\nprint(f(1))\n"), BlockLimit(4)]
    pieces = await collect(remote.infill(request))
    assert "".join(piece.text for piece in pieces) == "x = 1\n    y = 2\n\n    return y"
    assert pieces[-1].final and pieces[-1].stats is None  # cut before the server's last event


@pytest.mark.asyncio
async def test_session_names_are_stable_valid_and_this_language_server_s_own():
    remote, _ = backend(lambda request: httpx.Response(500))
    other, _ = backend(lambda request: httpx.Response(500))
    name = remote.session_name("lsp:file:///home/me/a b/ünïcode.py")
    assert name == remote.session_name("lsp:file:///home/me/a b/ünïcode.py")
    assert name != remote.session_name("lsp:file:///home/me/other.py")
    assert name != other.session_name("lsp:file:///home/me/a b/ünïcode.py")  # another editor, another session
    assert len(name) <= 128 and name.replace("-", "").isalnum()


@pytest.mark.asyncio
async def test_a_rewrite_drops_the_answer_s_fence_line_and_stops_at_the_closing_fence():
    def chunk(text, finish=None, **more):
        return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}], **more}

    remote, seen = backend(lambda request: httpx.Response(200, content=events(
        chunk("```py"), chunk("thon\ndef f(y):"), chunk("\n    return y"),
        chunk("", "stop", usage={"prompt_tokens": 50, "completion_tokens": 12,
                                 "prompt_tokens_details": {"cached_tokens": 0}}), done=True)))
    pieces = await collect(remote.rewrite(rewrite_request()))
    assert "".join(piece.text for piece in pieces) == "def f(y):\n    return y"
    assert pieces[-1].final and pieces[-1].stats.generated_tokens == 12
    body = json.loads(seen[0].content)
    assert seen[0].url.path == "/v1/chat/completions"
    assert body["messages"][0]["role"] == "user" and "def f(x):" in body["messages"][0]["content"]
    assert body["stop"] == ["\n```"] and body["prediction"]["content"] == "def f(x):\n    return x\n"
    assert body["spec"] == ["edit-align", "ngram-mod", "prompt-lookup"]


@pytest.mark.asyncio
@pytest.mark.parametrize("status, kind, words", [
    (401, JsonRpcException, "API key"), (429, Unavailable, "busy"), (503, Unavailable, "unavailable"),
    (400, JsonRpcException, "the prompt is empty")])
async def test_server_errors_become_json_rpc_errors(status, kind, words):
    remote, _ = backend(lambda request: httpx.Response(status, json={"error": {
        "code": status, "message": "the prompt is empty", "type": "x"}}))
    with pytest.raises(kind, match=words) as caught:
        await collect(remote.infill(infill_request()))
    assert caught.type is kind  # Unavailable only for what the next keystroke may find gone


@pytest.mark.asyncio
async def test_an_error_event_mid_stream_and_a_cut_stream_are_errors():
    remote, _ = backend(lambda request: httpx.Response(200, content=events(
        {"content": "x", "stop": False}, {"error": {"code": 500, "message": "internal server error", "type": "s"}})))
    with pytest.raises(JsonRpcException, match="internal server error"):
        await collect(remote.infill(infill_request()))
    remote, _ = backend(lambda request: httpx.Response(200, content=events({"content": "x", "stop": False})))
    with pytest.raises(JsonRpcException, match="ended the stream"):
        await collect(remote.infill(infill_request()))


@pytest.mark.asyncio
async def test_an_unreachable_server_is_unavailable():
    def refuse(request):
        raise httpx.ConnectError("connection refused")

    remote, _ = backend(refuse)
    with pytest.raises(Unavailable, match="cannot reach"):
        await collect(remote.rewrite(rewrite_request()))


@pytest.mark.asyncio
async def test_server_sent_events_are_read_by_the_format_s_rules():
    async def lines(*items):
        for item in items:
            yield item

    data = [d async for d in sse_data(lines(": a comment", "event: x", "data: {\"a\":", "data:1}", "", "",
                                            "data: [DONE]"))]
    assert data == ['{"a":\n1}', "[DONE]"]


def test_the_cli_takes_a_server_and_a_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("CODESPEC_API_KEY", "from-env")
    args = build_parser().parse_args(["lsp", "--server", "http://gpu-box:8012"])
    assert (args.server, args.api_key) == ("http://gpu-box:8012", "from-env")
