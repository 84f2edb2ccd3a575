"""What a web page, another client or a slow one can do to a local server: DNS rebinding (a foreign Host),
cross-origin browser posts (text/plain and form bodies need no CORS preflight), other keys' sessions, file paths in
request fields, and requests that never finish arriving."""

import socket
import sys
import time

import httpx
import pytest

from codespec.config import ServerConfig
from codespec.server import create_app, uvicorn_options
from tests.serving import live_server

PROMPT = "def total(values):\n    result = 0\n    for value in values:\n        result += value\n"
COMPLETION = {"prompt": "import os\n", "max_tokens": 2}


@pytest.fixture
def serve(engine):
    """serve(**ServerConfig fields) -> an httpx client of a live server with that configuration."""
    with_servers = []

    def start(**fields):
        config = ServerConfig(**fields)
        server = live_server(create_app(engine, config), **uvicorn_options(config))
        url = server.__enter__()
        with_servers.append(server)
        client = httpx.Client(base_url=url, timeout=60)
        client.port = int(url.rsplit(":", 1)[1])
        return client

    yield start
    for server in with_servers:
        server.__exit__(None, None, None)


def test_a_foreign_host_is_refused(serve):
    """A DNS-rebinding page reaches 127.0.0.1 under its own name: its requests carry that name as Host."""
    client = serve()
    for path in ("/slots", "/metrics", "/v1/models"):
        refused = client.get(path, headers={"host": f"attacker.example:{client.port}"})
        assert refused.status_code == 403 and "host" in refused.json()["error"]["message"].lower()
    refused = client.post("/v1/completions", json=COMPLETION, headers={"host": "attacker.example"})
    assert refused.status_code == 403
    for host in (f"localhost:{client.port}", f"127.0.0.1:{client.port}", f"[::1]:{client.port}", "localhost"):
        assert client.get("/slots", headers={"host": host}).status_code == 200, host


def test_allowed_hosts_and_the_bound_name(serve):
    client = serve(allowed_hosts=("codespec.lan", "*.corp.example"))
    for host in ("codespec.lan", "gpu.corp.example:8012"):
        assert client.get("/slots", headers={"host": host}).status_code == 200, host
    assert client.get("/slots", headers={"host": "codespec.lan.attacker.example"}).status_code == 403
    anything = serve(allowed_hosts=("*",))
    assert anything.get("/slots", headers={"host": "whatever.example"}).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_cross_origin_browser_post_is_refused(serve, content_type):
    """A page's fetch() or <form> with these content types needs no preflight; the browser names its origin."""
    client = serve()
    body = b'{"prompt": "import os\\n", "max_tokens": 2}'
    refused = client.post("/v1/completions", content=body,
                          headers={"content-type": content_type, "origin": "https://attacker.example"})
    assert refused.status_code == 403 and "origin" in refused.json()["error"]["message"].lower()
    assert "access-control-allow-origin" not in refused.headers
    same_origin = client.post("/v1/completions", json=COMPLETION,
                              headers={"origin": f"http://127.0.0.1:{client.port}"})  # the server's own /docs page
    assert same_origin.status_code == 200


def test_a_text_plain_body_is_not_read_as_json(serve):
    """Only curl's `-d` default (form-urlencoded) and a missing content type are read as JSON, as llama.cpp does."""
    client = serve()
    response = client.post("/v1/completions", content=b'{"prompt": "import os\\n", "max_tokens": 2}',
                           headers={"content-type": "text/plain"})
    assert response.status_code == 415 and "application/json" in response.json()["error"]["message"]


def test_allowed_origins_get_cors_headers(serve):
    client = serve(allowed_origins=("https://editor.example",))
    preflight = client.options("/v1/completions", headers={
        "origin": "https://editor.example", "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://editor.example"
    allowed = client.post("/v1/completions", json=COMPLETION, headers={"origin": "https://editor.example"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://editor.example"
    assert client.post("/v1/completions", json=COMPLETION,
                       headers={"origin": "https://attacker.example"}).status_code == 403


def test_the_key_guards_every_route_that_shows_sessions_or_prompts(serve):
    client = serve(api_key="s3cret")
    client.post("/infill", json={"input_prefix": PROMPT, "n_predict": 0, "session": "mine"},
                headers={"authorization": "Bearer s3cret"})
    for path in ("/slots", "/metrics", "/v1/models", "/openapi.json", "/docs"):
        refused = client.get(path)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", path
        assert "mine" not in refused.text
    assert client.get("/health").status_code == 200


def test_each_key_has_its_own_sessions(serve):
    """Guessing another client's prompt on its slot: tokens_cached said how much of the guess was right. Clients
    with different keys (comma-separated, as llama-server takes them) share no cache, slot or session name."""
    client = serve(api_key="alice-key,bob-key")
    alice, bob = ({"authorization": f"Bearer {key}"} for key in ("alice-key", "bob-key"))
    request = {"prompt": PROMPT, "max_tokens": 2, "id_slot": 0}
    assert client.post("/v1/completions", json=request, headers=alice).status_code == 200
    guess = client.post("/v1/completions", json=request, headers=bob).json()
    assert guess["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = client.post("/v1/completions", json=request, headers=alice).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "a key's own history is still reused"
    named = client.post("/infill", json={"input_prefix": PROMPT, "n_predict": 0, "session": "notes"}, headers=alice)
    assert named.json()["session"] == "notes"
    assert {s["session"] for s in client.get("/slots", headers=bob).json()} == {"slot-0"}
    assert {s["session"] for s in client.get("/slots", headers=alice).json()} == {"slot-0", "notes"}
    bobs_try = client.post("/infill", json={"input_prefix": PROMPT, "n_predict": 1, "session": "notes"},
                           headers=bob).json()
    assert bobs_try["tokens_cached"] == 0
    assert client.post("/v1/completions", json=request,
                       headers={"authorization": "Bearer alice-key,bob-key"}).status_code == 401


def test_no_request_field_opens_a_file(serve, tmp_path):
    """Paths in every field that names a file or a model: the server opens none of them."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET\n")
    opened = []

    def audit(event, args):
        if event == "open" and args and str(args[0]).startswith(str(tmp_path)):
            opened.append(args[0])

    sys.addaudithook(audit)  # (hooks cannot be removed; this one only records paths under tmp_path)
    client = serve()
    path = str(secret)
    requests = [
        ("/infill", {"input_prefix": "x = 1\n", "n_predict": 2, "filename": path,
                     "input_extra": [{"filename": path, "text": "y = 2\n"}], "ngram_cache": path,
                     "draft_model": path, "model": path, "spec": "ngram-cache"}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "model": path, "draft_model": path,
                             "spec": "draft", "ngram_cache": path}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": path,
                                  "lora": path, "grammar_file": path}),
    ]
    for route, body in requests:
        response = client.post(route, json=body)
        assert response.status_code < 500 and "TOP SECRET" not in response.text
    assert opened == []


def raw_connection(client) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", client.port))
    sock.settimeout(10)
    return sock


def test_stalled_request_headers_are_dropped(serve):
    client = serve(read_timeout=1.0)
    sock = raw_connection(client)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
    started = time.monotonic()
    assert sock.recv(1024) == b""  # closed
    assert time.monotonic() - started < 5
    idle = raw_connection(client)  # a connection that sends nothing at all
    assert idle.recv(1024) == b""


def test_a_stalled_request_body_is_408(serve):
    client = serve(read_timeout=1.0)
    sock = raw_connection(client)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # 11 of 100 bytes
    started = time.monotonic()
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":408' in answer.replace(b" ", b"")
    assert time.monotonic() - started < 5
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200  # a slow body blocks nobody
