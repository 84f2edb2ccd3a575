"""ASGI middleware: request metrics, the API key, and the request-size limit. Plain ASGI (not BaseHTTPMiddleware),
so streamed responses pass through untouched and a client's disconnect still reaches the route."""

from __future__ import annotations

import json
import secrets
import time

PUBLIC_PATHS = {"/health"}  # answered without the API key: liveness probes carry no secrets


async def send_error(send, status: int, message: str, kind: str, headers=()) -> None:
    body = json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ApiKey:
    """Every request but /health needs `Authorization: Bearer KEY` (401 otherwise)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                await send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                 "authentication_error", [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    pass


class SizeLimit:
    """Bodies over `limit` bytes get 413, by Content-Length before reading, or while reading a chunked body."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await send_error(send, 413, f"the request body is over {self.limit} bytes",
                                    "invalid_request_error")
        received, started = 0, False

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await send_error(send, 413, f"the request body is over {self.limit} bytes", "invalid_request_error")


class RequestMetrics:
    """Counts requests by route and status and times them to the last byte (streams included)."""

    def __init__(self, app, metrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"
        status, started = 500, time.perf_counter()

        async def recording_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)


class JsonByDefault:
    """Reads a POST body without a JSON content type as JSON, as llama.cpp does: `curl -d '{...}'` sends
    application/x-www-form-urlencoded, and FastAPI would otherwise not parse it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = dict(scope["headers"]).get(b"content-type", b"")
            if not given.startswith(b"application/json"):
                scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
