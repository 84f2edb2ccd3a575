"""The HTTP server: llama.cpp-compatible /infill, OpenAI-compatible completions and chat, health, models, metrics,
slots. Routes stay thin: request bodies are validated by schemas.py, slots and llama.cpp's fields are generation.py's,
prompt -> session -> job and text limits the request layer's (codespec.request), FIM prompts codespec.context.fim's;
one scheduler owns the engine."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from .. import __version__
from ..config import SamplingParams, ServerConfig
from ..context.fim import SuffixTrimmer, fim_prompt, prompt_budget
from ..errors import CodespecError, DeviceMemoryFull
from ..request import LLAMA_CPP, BlockLimit, Prompt
from ..scheduler import QueueFull, Scheduler
from .generation import Generation, Generations, Plan
from .metrics import Metrics
from .middleware import ApiKey, BrowserGuard, JsonByDefault, ReadTimeout, RequestMetrics, SizeLimit
from .schemas import (ChatRequest, ChatResponse, CompletionRequest, CompletionResponse, ErrorResponse, Health,
                      InfillRequest, InfillResponse, LlamaCompletionRequest, ModelCard, ModelList, OpenAIOptions,
                      SelectedFields, Slot)

log = logging.getLogger("codespec.server")
# every route: a wrong key, a foreign Host or Origin, a bug; a body's routes: its mistakes, limits and the queue
ANY_ROUTE_ERRORS = {status: {"model": ErrorResponse} for status in (401, 403, 500)}
BODY_ERRORS = {status: {"model": ErrorResponse} for status in (400, 408, 413, 415, 422, 429, 503)}
OPENAI_ERRORS = {**BODY_ERRORS, 404: {"model": ErrorResponse}}  # and a model name this server does not serve
ROUTES = {"/infill", "/completion", "/v1/completions", "/v1/chat/completions", "/health", "/v1/models", "/metrics",
          "/slots"}


class Unsupported(CodespecError):
    """A parameter whose value codespec cannot honour: a 400 that names it (OpenAI's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class UnknownModel(Exception):
    """A model name this server does not serve: OpenAI's 404 model_not_found."""


def streamed(description: str) -> dict:
    """The OpenAPI entry of a route's `stream: true` answer: server-sent events (the schema is one event's), each
    event's data a JSON object or the final [DONE]."""
    json_object = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"type": "object"}}
    event = {"type": "object", "required": ["data"], "description": description,
             "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_object]}}}
    return {200: {"content": {"text/event-stream": {"schema": event}},
                  "description": "JSON, or with `stream: true` server-sent events"}}


def error(status: int, message: str, kind: str = "invalid_request_error", headers=None, **extra) -> Response:
    """The one error shape. json.dumps escapes what is not ASCII, so a message can never fail to encode."""
    body = {"error": {"code": status, "message": message, "type": kind, **extra}}
    return Response(json.dumps(body), status_code=status, media_type="application/json", headers=headers)


def error_event(status: int, message: str, kind: str) -> bytes:
    return sse({"error": {"code": status, "message": message, "type": kind}})


def sse(data) -> bytes:
    return format_sse_event(data_str=data if isinstance(data, str) else json.dumps(data))


def event_stream(events) -> EventSourceResponse:
    return EventSourceResponse(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def select_fields(body: dict, fields: list[str] | None) -> dict:
    """llama.cpp's response_fields: only these fields, a nested one ('timings/prompt_n') under its path; none or []:
    every field (as llama.cpp)."""
    if not fields:
        return body
    selected = {}
    for path in fields:
        value, found = body, bool(path)
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                found = False
                break
            value = value[key]
        if found:
            selected[path] = value
    return selected


def create_app(engine, config: ServerConfig | None = None, params: SamplingParams | None = None, spec=None,
               model_name: str = "codespec", model_aliases=()) -> FastAPI:
    """model_name: the id /v1/models lists; a request's `model` must be it, one of model_aliases, or empty."""
    config = config or ServerConfig()
    known_models = {model_name, *model_aliases}
    config.validate()
    engine.session_memory = config.session_memory
    scheduler = Scheduler(engine, config.max_queue, config.parallel)
    # the adaptive cost table, on the worker's thread (its OpenMP team), now rather than in the first request: ~4 s
    # on a machine that has none for this code yet (adaptive.cached_costs), a file read otherwise
    costs = scheduler.call_soon(lambda engine: engine.costs)
    metrics = Metrics(scheduler)
    generations = Generations(scheduler, metrics, config, params or SamplingParams(), spec or engine.spec)

    @asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()

    app = FastAPI(title="codespec", version=__version__, lifespan=lifespan, responses=ANY_ROUTE_ERRORS,
                  description="Lossless self-speculative decoding for coding assistants: llama.cpp-compatible "
                              "/infill and OpenAI-compatible completions.")
    app.state.scheduler, app.state.metrics, app.state.engine, app.state.costs = scheduler, metrics, engine, costs

    # -- errors: every client mistake is a 4xx JSON body in one shape ------------------------------------------

    @app.exception_handler(QueueFull)
    async def queue_full(request, exc):
        return error(429, str(exc), "rate_limit_error")

    @app.exception_handler(DeviceMemoryFull)
    async def device_full(request, exc):  # the server is fine; the GPU is full for now
        return error(503, str(exc), "server_error")

    @app.exception_handler(CodespecError)
    async def bad_request(request, exc):
        return error(400, str(exc), **({"param": exc.param} if isinstance(exc, Unsupported) else {}))

    @app.exception_handler(UnknownModel)
    async def unknown_model(request, exc):
        return error(404, f"The model '{exc}' does not exist; this server serves '{model_name}' (GET /v1/models)",
                     param="model", code="model_not_found")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return error(400, "the body is not valid JSON")
        where = "; ".join(f"{'.'.join(str(part) for part in p['loc'][1:]) or 'body'}: {p['msg']}" for p in problems)
        detail = [{key: p[key] for key in ("loc", "msg", "type") if key in p} for p in problems]
        return error(422, where, detail=json.loads(json.dumps(detail, default=str)))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        kind = {404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error"}.get(exc.status_code,
                                                                                              "http_error")
        return error(exc.status_code, str(exc.detail), kind, headers=exc.headers)  # 405's Allow, 408's Connection

    @app.exception_handler(Exception)
    async def bug(request, exc):
        """Anything else is a bug: a JSON 500, never plain text. Starlette raises the exception again afterwards
        (uvicorn logs it and closes the connection), so the client is told not to reuse the connection."""
        return error(500, f"internal server error ({type(exc).__name__}); the server's log has the details",
                     "server_error", headers={"Connection": "close"})

    def tenant(request: Request) -> str:
        """The session namespace of the request's API key ('' with none or one key)."""
        return getattr(request.state, "tenant", "")

    # -- helpers shared by the generation routes -------------------------------------------------------------

    def check_model(name: str | None) -> None:
        """OpenAI answers 404 for a model it does not serve; no name or "" (llama.vim's default) is this one."""
        if name and name not in known_models:
            raise UnknownModel(name)

    def check_openai(body: OpenAIOptions) -> None:
        check_model(body.model)
        problem = body.unsupported()
        if problem:
            raise Unsupported(*problem)

    def answer(body: dict, fields: list[str] | None, model=None):
        """A whole (not streamed) answer, checked against `model` where the route's response model is a union; or
        llama.cpp's response_fields selection of it (not checked: the union would take a broken body for one)."""
        if fields:
            return JSONResponse(select_fields(body, fields))
        return model.model_validate(body) if model is not None else body

    async def finish(request: Request, run: Generation) -> Response | None:
        """Collect a run while watching the client; None when it completed, a 499 when the client left."""
        collecting = asyncio.ensure_future(generations.collect(run))
        watching = asyncio.ensure_future(disconnected(request))
        done, _ = await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        if collecting in done:
            watching.cancel()
            collecting.result()  # re-raises the engine's error
            return None
        collecting.cancel()  # its cleanup cancels the job: the slot is free at the next step boundary
        try:
            await collecting
        except asyncio.CancelledError:
            pass
        return Response(status_code=499)

    def infill_body(run: Generation) -> dict:
        return {"content": run.text, "stop": True, "stop_type": run.stop_type, "stopping_word": run.stop_word,
                "tokens_predicted": run.stats.generated_tokens, "tokens_evaluated": len(run.prompt.ids),
                "tokens_cached": run.cached, "truncated": run.prompt.truncated, "model": model_name,
                "session": None if run.temporary else run.session_name, "timings": run.timings(),
                "speculation": run.speculation()}

    def usage(run: Generation) -> dict:
        prompt, completion = len(run.prompt.ids), run.stats.generated_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": run.cached}}

    async def start(route: str, body, request: Request, build) -> Generation:
        """The route's generation: the server's settings with the body's, its session (in the API key's namespace),
        and its prompt, build(engine, params) -> Prompt on the engine's worker."""
        params, spec = generations.settings(body)
        namespace = tenant(request)
        return await generations.start(Plan(route, lambda engine: build(engine, params), params, spec,
                                            generations.session_name(body, namespace), body.cache_prompt,
                                            body.requested_tokens() == 0, body.t_max_predict_ms, namespace))

    async def llama_answer(run: Generation, body, request: Request):
        """/infill's and /completion's answer: streamed as {"content": piece} events, or whole; a warm-up is never
        a stream (llama.vim reads its answer as JSON)."""
        if body.stream and not run.plan.warm_only:
            return event_stream(stream_events(run, lambda delta: {"content": delta, "stop": False},
                                              lambda: [{**infill_body(run), "content": ""}], done=False))
        return await finish(request, run) or answer(infill_body(run), body.response_fields, InfillResponse)

    async def stream_events(run: Generation, piece, last, done: bool):
        """SSE: one event per text piece, then the last ones; `data: [DONE]` after them for OpenAI routes. The status
        line is sent already when something fails: the error is the last event (then [DONE]), not a cut stream."""
        try:
            async for delta in generations.deltas(run):
                yield sse(piece(delta))
            for event in last():
                yield sse(event)
        except DeviceMemoryFull as exc:
            yield error_event(503, str(exc), "server_error")
        except CodespecError as exc:
            yield error_event(400, str(exc), "invalid_request_error")
        except Exception as exc:
            log.exception("a streamed generation failed")
            yield error_event(500, f"internal server error ({type(exc).__name__}); the server's log has the "
                                   "details", "server_error")
        if done:
            yield sse("[DONE]")

    # -- routes --------------------------------------------------------------------------------------------

    @app.post("/infill", response_model=InfillResponse | SelectedFields,
              responses={**streamed('{"content": piece, "stop": false} events, then the InfillResponse with '
                                    'empty content; a failure: {"error": ...}'),
                         **BODY_ERRORS})
    async def infill(body: InfillRequest, request: Request):
        """llama.cpp's fill-in-the-middle endpoint (llama.vim's). `n_predict: 0` only warms the session's cache."""
        extra = [(chunk.filename, chunk.text) for chunk in body.input_extra]

        def build(engine, params) -> Prompt:
            # the context the text may need: what was asked for, else a little (generation ends at the context)
            requested = body.requested_tokens()
            budget = prompt_budget(engine.context_length, params.max_tokens if requested else 0, limited=requested > 0)
            # healed: a cursor on an empty line or inside a name starts the suggestion where a person expects
            fim = fim_prompt(engine.tokenizer, body.input_prefix + body.prompt, body.input_suffix, extra,
                             body.filename, max_tokens=budget, vocabulary=engine.vocabulary)
            limits = []
            if fim.format is None and body.input_suffix.strip():
                limits.append(SuffixTrimmer(body.input_suffix))  # no FIM tokens: stop where it meets the suffix
            if body.n_indent:
                limits.append(BlockLimit(body.n_indent, LLAMA_CPP))
            return Prompt(fim.ids, fim.truncated, fim.stop_ids, limits, fim.healed)

        return await llama_answer(await start("/infill", body, request, build), body, request)

    @app.post("/completion", response_model=InfillResponse | SelectedFields,
              responses={**streamed('{"content": piece, "stop": false} events, then the InfillResponse with '
                                    'empty content; a failure: {"error": ...}'),
                         **BODY_ERRORS})
    async def completion(body: LlamaCompletionRequest, request: Request):
        """llama.cpp's own completion endpoint: the prompt (text or token ids) continued, answered as /infill is.
        `n_predict: 0` only warms the session's cache."""
        def build(engine, params) -> Prompt:
            limits = [BlockLimit(body.n_indent, LLAMA_CPP)] if body.n_indent else []
            return Prompt(prompt_ids(engine, body.prompt), limits=limits)

        return await llama_answer(await start("/completion", body, request, build), body, request)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**streamed("OpenAI completion chunks (a failure: {\"error\": ...}), then [DONE]"),
                         **OPENAI_ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI text completion; with `suffix`, fill-in-the-middle. `n_predict` or `max_tokens` 0 only warms
        the session's cache."""
        check_openai(body)

        def build(engine, params) -> Prompt:
            if body.suffix is None:
                return Prompt(prompt_ids(engine, body.prompt))
            fim = fim_prompt(engine.tokenizer, body.prompt, body.suffix)
            limits = [SuffixTrimmer(body.suffix)] if fim.format is None and body.suffix.strip() else []
            return Prompt(fim.ids, False, fim.stop_ids, limits)

        run = await start("/v1/completions", body, request, build)
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish_reason=None, **more):
            return {"id": ident, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
                    **more}

        def complete(text):
            return chunk(text, run.finish_reason, usage=usage(run), timings=run.timings(),
                         speculation=run.speculation())

        def last():
            usage_only = {"id": ident, "object": "text_completion", "created": created, "model": model_name,
                          "choices": [], "usage": usage(run)}
            return [complete(""), *([usage_only] if body.include_usage else [])]

        if body.stream:  # a warm-up too: an OpenAI client reads a stream (its last chunk, then [DONE])
            return event_stream(stream_events(run, chunk, last, done=True))
        return await finish(request, run) or answer(complete(run.text), body.response_fields)

    @app.post("/v1/chat/completions", response_model=ChatResponse,
              responses={**streamed("OpenAI chat completion chunks (a failure: {\"error\": ...}), then [DONE]"),
                         **OPENAI_ERRORS})
    async def chat(body: ChatRequest, request: Request):
        """OpenAI chat completion, with the model's chat template. `n_predict` or `max_tokens` 0 only warms the
        session's cache (llama.vim's instruction warm-up)."""
        check_openai(body)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]

        def build(engine, params) -> Prompt:
            if not getattr(engine.tokenizer, "chat_template", None):
                raise CodespecError("this model has no chat template; use /v1/completions")
            ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
            return Prompt(list(ids["input_ids"] if isinstance(ids, dict) else ids))

        run = await start("/v1/chat/completions", body, request, build)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first = [True]

        def chunk(delta, finish_reason=None, **more):
            content = {"role": "assistant", "content": delta} if first[0] else {"content": delta}
            first[0] = False
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": content, "finish_reason": finish_reason}], **more}

        def last():
            usage_only = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_name,
                          "choices": [], "usage": usage(run)}
            return [chunk("", run.finish_reason, usage=usage(run), timings=run.timings(),
                          speculation=run.speculation()), *([usage_only] if body.include_usage else [])]

        if body.stream:  # a warm-up too: an OpenAI client reads a stream (its last chunk, then [DONE])
            return event_stream(stream_events(run, chunk, last, done=True))
        return await finish(request, run) or answer({
            "id": ident, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": run.text},
                         "finish_reason": run.finish_reason}],
            "usage": usage(run), "timings": run.timings(), "speculation": run.speculation()}, body.response_fields)

    @app.get("/health", response_model=Health)
    async def health():
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "codespec",
                "meta": {"context_length": engine.context_length, "spec": list(generations.spec.spec),
                         "vocab_size": int(engine.model.config.vocab_size)}}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def model(model: str):
        """The served model, under its id or an alias; any other name is OpenAI's 404 model_not_found."""
        check_model(model or "?")
        return model_card()

    @app.get("/slots", response_model=list[Slot])
    async def slots(request: Request):
        """Every named session of this API key: its length, cached tokens, KV-cache bytes, and each drafter's
        statistics."""
        namespace = tenant(request)

        def read(engine):
            busy = scheduler.busy_sessions()
            return [{"id": info.id.removeprefix(namespace), "busy": info.id in busy, "tokens": info.tokens,
                     "cached": info.cached, "cache_bytes": info.cache_bytes, "spec": list(info.spec),
                     "drafters": [stats.to_dict() for stats in info.drafters]}
                    for info in engine.sessions_info(namespace)]
        return await scheduler.acall(read)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}})
    async def prometheus():
        def read(engine):
            return (len(engine.sessions_info()), engine.sessions_bytes(),
                    max((pool.occupancy for pool in engine.shared.pools), default=0.0))
        count, total, occupancy = await scheduler.acall(read)
        metrics.sessions.set(count)
        metrics.session_bytes.set(total)
        metrics.pool_occupancy.set(occupancy)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # the last added runs first: metrics see every answer (403, 401 and 413 too); a web page's requests are refused
    # before anything else; CORS preflights (no key) are answered before the key is checked, the key before the body
    app.add_middleware(JsonByDefault)
    app.add_middleware(SizeLimit, limit=config.max_request_bytes)
    app.add_middleware(ReadTimeout, seconds=config.read_timeout)
    keys = [key for key in (config.api_key or "").split(",") if key]
    if keys:
        app.add_middleware(ApiKey, keys=keys)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    app.add_middleware(BrowserGuard, bound_host=config.host, allowed_hosts=config.allowed_hosts,
                       allowed_origins=config.allowed_origins)
    app.add_middleware(RequestMetrics, metrics=metrics, routes=ROUTES)
    return app


def prompt_ids(engine, prompt: str | list[int]) -> list[int]:
    """A prompt's tokens: text exactly as `codespec generate` tokenises it; token ids checked to be in the
    vocabulary."""
    if isinstance(prompt, str):
        return engine.encode(prompt)  # raises "the prompt is empty" for ""
    vocabulary = int(engine.model.config.vocab_size)
    outside = next((token for token in prompt if token >= vocabulary), None)
    if outside is not None:
        raise Unsupported("prompt", f"token id {outside} is outside the vocabulary (0..{vocabulary - 1})")
    return list(prompt)


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
