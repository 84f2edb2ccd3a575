"""The one error shape: every client mistake is a 4xx JSON body `{"error": {"code", "message", "type", ...}}`, a bug
a JSON 500. Here are its body, its OpenAPI declarations, the exceptions routes raise for OpenAI's 400 and 404, and
the app's exception handlers (install_error_handlers)."""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from ..errors import CodespecError, DeviceMemoryFull
from ..scheduler import QueueFull
from .llamacpp import ContextExceeded
from .schemas import ErrorResponse

# every route: a wrong key, a foreign Host or Origin, a bug; a body's routes: its mistakes, limits and the queue
ANY_ROUTE_ERRORS = {status: {"model": ErrorResponse} for status in (401, 403, 500)}
BODY_ERRORS = {status: {"model": ErrorResponse} for status in (400, 408, 413, 415, 422, 429, 503)}
OPENAI_ERRORS = {**BODY_ERRORS, 404: {"model": ErrorResponse}}  # and a model name this server does not serve
# llama-server's own routes answer an invalid body with 400 (llama-server has no 422): their errors
LLAMA_CPP_ERRORS = {status: {"model": ErrorResponse} for status in (400, 408, 413, 415, 429, 503)}
LLAMA_CPP_ROUTES = frozenset({"/completion", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props",
                              "/slots"})


class Unsupported(CodespecError):
    """A parameter whose value codespec cannot honour: a 400 that names it (OpenAI's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class UnknownModel(Exception):
    """A model name this server does not serve: OpenAI's 404 model_not_found."""


def error_body(status: int, message: str, kind: str = "invalid_request_error", **extra) -> dict:
    return {"error": {"code": status, "message": message, "type": kind, **extra}}


def error(status: int, message: str, kind: str = "invalid_request_error", headers=None, **extra) -> Response:
    """The one error shape. json.dumps escapes what is not ASCII, so a message can never fail to encode."""
    body = error_body(status, message, kind, **extra)
    return Response(json.dumps(body), status_code=status, media_type="application/json", headers=headers)


# -- the exception handlers ------------------------------------------------------------------------------------


async def queue_full(request, exc):
    return error(429, str(exc), "rate_limit_error")


async def device_full(request, exc):  # the server is fine; the GPU is full for now
    return error(503, str(exc), "server_error")


async def bad_request(request, exc):
    return error(400, str(exc), **({"param": exc.param} if isinstance(exc, Unsupported) else {}))


async def context_exceeded(request, exc):
    """llama-server's answer, on its routes and the OpenAI ones alike: both numbers inside `error`."""
    return error(400, str(exc), "exceed_context_size_error", n_prompt_tokens=exc.n_prompt_tokens, n_ctx=exc.n_ctx)


async def unknown_model(request, exc):
    served = request.app.state.server.model_name
    return error(404, f"The model '{exc}' does not exist; this server serves '{served}' (GET /v1/models)",
                 param="model", code="model_not_found")


async def invalid(request, exc):
    problems = exc.errors()
    if any(p.get("type") == "json_invalid" for p in problems):
        return error(400, "the body is not valid JSON")
    where = "; ".join(f"{'.'.join(str(part) for part in p['loc'][1:]) or 'body'}: {p['msg']}" for p in problems)
    detail = [{key: p[key] for key in ("loc", "msg", "type") if key in p} for p in problems]
    status = 400 if request.url.path in LLAMA_CPP_ROUTES else 422  # llama-server's routes: its 400
    return error(status, where, detail=json.loads(json.dumps(detail, default=str)))


async def http_error(request, exc):
    kind = {404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error"}.get(exc.status_code,
                                                                                          "http_error")
    return error(exc.status_code, str(exc.detail), kind, headers=exc.headers)  # 405's Allow, 408's Connection


async def bug(request, exc):
    """Anything else is a bug: a JSON 500, never plain text. Starlette raises the exception again afterwards
    (uvicorn logs it and closes the connection), so the client is told not to reuse the connection."""
    return error(500, f"internal server error ({type(exc).__name__}); the server's log has the details",
                 "server_error", headers={"Connection": "close"})


HANDLERS = ((QueueFull, queue_full), (DeviceMemoryFull, device_full), (ContextExceeded, context_exceeded),
            (CodespecError, bad_request),
            (UnknownModel, unknown_model), (RequestValidationError, invalid), (HTTPException, http_error),
            (Exception, bug))


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app's routes and middleware raise, answered in the one shape."""
    for exception, handler in HANDLERS:
        app.add_exception_handler(exception, handler)
