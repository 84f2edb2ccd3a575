"""A real uvicorn serving an app on a free loopback port, in a background thread, for the server tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn


@contextmanager
def live_server(app, **options):
    """Yields the base URL; stops the server (and runs the app's shutdown) afterwards. `options`: more uvicorn.Config
    arguments (codespec.server.uvicorn_options)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def sse_events(response) -> list:
    """The data of each server-sent event, JSON-decoded except the final [DONE]."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def start_codespec_serve(port: int) -> tuple[subprocess.Popen, httpx.Client]:
    """A real `codespec serve` process on the default model in float32 (no API key), once it answers /health."""
    env = {**os.environ, "CODESPEC_API_KEY": ""}
    process = subprocess.Popen([sys.executable, "-m", "codespec", "serve", "--port", str(port), "--dtype", "float32"],
                               stderr=subprocess.PIPE, text=True, env=env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, process.stderr.read()
        try:
            if client.get("/health").status_code == 200:
                return process, client
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


@contextmanager
def running_codespec_serve():
    """start_codespec_serve on a free port for a `with` block (a module fixture): yields the client, then stops it."""
    process, client = start_codespec_serve(free_port())
    try:
        yield client
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def tiny_client(engine):
    """httpx against the real app on `engine` (the tiny model's), two slots, on a live uvicorn."""
    from codespec.config import ServerConfig
    from codespec.server import create_app

    with live_server(create_app(engine, ServerConfig(slots=2))) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
