"""The HTTP server: llama.cpp-compatible /infill, OpenAI-compatible completions and chat, health, models, metrics,
slots. create_app only wires: the routes are routes/' APIRouters, and stay thin: request bodies are validated by
schemas.py, slots and llama.cpp's fields are generation.py's, prompt -> session -> job and text limits the request
layer's (codespec.request), FIM prompts codespec.context.fim's; errors answer in errors.py's one shape; one
scheduler owns the engine, and the routes reach it through the app's ServerState (state.py)."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from .. import __version__
from ..config import SamplingParams, ServerConfig
from ..scheduler import Scheduler
from .errors import ANY_ROUTE_ERRORS, install_error_handlers
from .generation import Generations
from .metrics import Metrics
from .middleware import ApiKey, BrowserGuard, JsonByDefault, ReadTimeout, RequestMetrics, SizeLimit
from .routes import ALIASES, ROUTERS
from .state import ServerState

ROUTES = {"/infill", "/completion", "/v1/completions", "/v1/chat/completions", "/health", "/v1/models", "/metrics",
          "/slots", "/props", "/tokenize", "/detokenize", "/apply-template", *ALIASES}


@asynccontextmanager
async def lifespan(app: FastAPI):
    yield
    app.state.scheduler.close()


def create_app(engine, config: ServerConfig | None = None, params: SamplingParams | None = None, spec=None,
               model_name: str = "codespec", model_aliases=(), model_path: str | None = None) -> FastAPI:
    """model_name: the id /v1/models lists; a request's `model` must be it, one of model_aliases, or empty.
    model_path: what /props says the model was loaded from (default: the GGUF file, else the model's directory)."""
    config = config or ServerConfig()
    engine.session_memory = config.session_memory
    scheduler = Scheduler(engine, config.max_queue, config.parallel)
    # the adaptive cost table, on the worker's thread (its OpenMP team), now rather than in the first request: ~4 s
    # on a machine that has none for this code yet (adaptive.cached_costs), a file read otherwise
    costs = scheduler.call_soon(lambda engine: engine.costs)
    metrics = Metrics(scheduler)
    generations = Generations(scheduler, metrics, config, params or SamplingParams(), spec or engine.spec)

    app = FastAPI(title="codespec", version=__version__, lifespan=lifespan, responses=ANY_ROUTE_ERRORS,
                  description="Lossless self-speculative decoding for coding assistants: llama.cpp-compatible "
                              "/infill and OpenAI-compatible completions.")
    app.state.server = ServerState(config, engine, scheduler, metrics, generations, costs, model_name,
                                   frozenset({model_name, *model_aliases}),
                                   model_path or loaded_from(engine, model_name))
    app.state.scheduler, app.state.metrics, app.state.engine, app.state.costs = scheduler, metrics, engine, costs
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    install_middleware(app, config, metrics)
    return app


def loaded_from(engine, model_name: str) -> str:
    if getattr(engine, "gguf", None):
        return str(engine.gguf)
    return str(getattr(engine.model.config, "_name_or_path", "") or model_name)


def install_middleware(app: FastAPI, config: ServerConfig, metrics: Metrics) -> None:
    """The last added runs first: metrics see every answer (403, 401 and 413 too); a web page's requests are refused
    before anything else; CORS preflights (no key) are answered before the key is checked, the key before the
    body."""
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
