"""ASGI middleware: request metrics, what a web page may send, the API key, the request-size and read-time limits, and
JSON bodies without a JSON content type. Plain ASGI (not BaseHTTPMiddleware), so streamed responses pass through
untouched and a client's disconnect still reaches the route. Limits found while the route reads the body are raised
as HTTPExceptions from `receive`: FastAPI passes those on to the app's handler, which answers in the error shape."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import time
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException

PUBLIC_PATHS = {"/health", "/v1/health"}  # answered without the API key: liveness probes carry no secrets


async def send_error(send, status: int, message: str, kind: str, headers=()) -> None:
    body = json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def header(scope, name: bytes) -> str | None:
    value = dict(scope["headers"]).get(name)
    return None if value is None else value.decode("latin-1")


class BrowserGuard:
    """Refuses (403) what a web page could send to a server on this machine. A DNS-rebinding page reaches 127.0.0.1
    under its own name, which arrives as the Host, and could then read the answers, /slots and /metrics: only
    localhost, IP addresses (a rebinding needs a name), the bound host and `allowed_hosts` are served ('*.lan'
    matches under lan, '*' any). A page's fetch() or form from another origin carries an Origin header, also
    when it sends text/plain or a form, which need no CORS preflight: only the server's own origin and
    `allowed_origins` ('*': any) are served. Clients that are not browsers (curl, editors, SDKs) send no Origin."""

    def __init__(self, app, bound_host: str, allowed_hosts=(), allowed_origins=()):
        names = {"localhost", bound_host.lower(), *(name.lower() for name in allowed_hosts)}
        self.app, self.any_host = app, "*" in names
        self.names = {name for name in names if not name.startswith("*")}
        self.suffixes = tuple(name[1:] for name in names if name.startswith("*."))
        self.origins = {origin.rstrip("/").lower() for origin in allowed_origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host, origin = header(scope, b"host"), header(scope, b"origin")
            if host is not None and not self.host_allowed(host):
                return await send_error(send, 403, f"Host {host!r} is not this server's name (DNS rebinding?); "
                                                   "allow it with --allowed-hosts", "permission_error")
            if origin is not None and not self.origin_allowed(origin, host):
                return await send_error(send, 403, f"requests from web pages of origin {origin!r} are refused; "
                                                   "allow it with --allowed-origins", "permission_error")
        await self.app(scope, receive, send)

    def host_allowed(self, host: str) -> bool:
        if self.any_host:
            return True
        try:
            name = urlsplit("//" + host).hostname or ""  # without the port and an IPv6 address's brackets
        except ValueError:
            return False
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        return name in self.names or any(name.endswith(suffix) for suffix in (".localhost", *self.suffixes))

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        same_origin = host is not None and urlsplit(origin).netloc == host.lower()  # e.g. the server's /docs page
        return same_origin and urlsplit(origin).scheme in ("http", "https")


class ApiKey:
    """Every request but /health (and CORS preflights, answered outside) needs `Authorization: Bearer KEY` or, as
    llama-server also takes it, `X-Api-Key: KEY` (401 otherwise), compared in constant time with every key; a
    request with both is let in by either. With several keys each request carries its key's namespace in
    `scope["state"]["tenant"]`: clients with different keys share no session, slot or cache."""

    def __init__(self, app, keys: list[str]):
        self.app, self.expected = app, [f"Bearer {key}".encode() for key in keys]
        self.tenants = [""] if len(keys) == 1 else [f"k{index}|" for index in range(len(keys))]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            headers = dict(scope["headers"])
            given = [headers.get(b"authorization", b""), b"Bearer " + headers.get(b"x-api-key", b"")]
            # every key against both headers, always: the time does not tell which part matched
            matches = [[secrets.compare_digest(sent, expected) for sent in given] for expected in self.expected]
            matches = [any(pair) for pair in matches]
            if not any(matches):
                return await send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer KEY' "
                                                   "or 'X-Api-Key: KEY'",
                                        "authentication_error", [(b"www-authenticate", b"Bearer")])
            scope.setdefault("state", {})["tenant"] = self.tenants[matches.index(True)]
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over {limit} bytes")


class SizeLimit:
    """Bodies over `limit` bytes get 413, by Content-Length before reading, or while reading a chunked body."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await send_error(send, 413, f"the request body is over {self.limit} bytes",
                                    "invalid_request_error", [(b"connection", b"close")])
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counting_receive, send)


class ReadTimeout:
    """A body that has not arrived `seconds` after the headers gets 408 (uvicorn waits for it forever). Only the
    body is timed: afterwards `receive` waits, as it should, for a disconnect that may come much later."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline, body_done = time.monotonic() + self.seconds, False

        async def timed_receive():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.seconds:g} s",
                                    headers={"Connection": "close"}) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


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


JSON_LIKE = (b"", b"application/x-www-form-urlencoded")  # none, and curl -d's default


class JsonByDefault:
    """Reads a POST body sent with no content type or curl's `-d` default (form-urlencoded) as JSON, as llama.cpp
    does, so `curl -d '{...}'` works. Other non-JSON types (text/plain, multipart) get 415."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            given = dict(scope["headers"]).get(b"content-type", b"")
            media_type = given.split(b";")[0].strip().lower()
            if media_type in JSON_LIKE:
                headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
            elif media_type != b"application/json" and not media_type.endswith(b"+json"):
                return await send_error(send, 415, f"send the body as JSON (Content-Type: application/json), not "
                                                   f"{media_type.decode('latin-1')!r}", "invalid_request_error")
        await self.app(scope, receive, send)
