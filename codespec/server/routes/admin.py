"""What the server tells about itself: /health (answered without the API key), the model it serves (OpenAI's
/v1/models), its settings (llama-server's /props), the API key's sessions (llama.cpp's /slots) and its Prometheus
/metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..llamacpp import BUILD_INFO, chat_template, is_speculative, params_json
from ..schemas import ErrorResponse, Health, ModelCard, ModelList, Props, Slot
from ..state import Server, ServerState
from .common import tenant

router = APIRouter()


@router.get("/health", response_model=Health)
async def health():
    return {"status": "ok"}


def model_card(server: ServerState) -> dict:
    engine = server.engine
    return {"id": server.model_name, "object": "model", "created": 0, "owned_by": "codespec",
            "meta": {"context_length": engine.context_length, "spec": list(server.generations.spec.spec),
                     "vocab_size": int(engine.model.config.vocab_size)}}


@router.get("/v1/models", response_model=ModelList)
async def models(server: Server):
    return {"object": "list", "data": [model_card(server)]}


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
async def model(model: str, server: Server):
    """The served model, under its id or an alias; any other name is OpenAI's 404 model_not_found."""
    server.check_model(model or "?")
    return model_card(server)


def default_params(server: ServerState) -> dict:
    """The settings a request that sets none runs with, in llama-server's names (n_predict: the server's cap)."""
    generations = server.generations
    return params_json(generations.params, generations.spec, server.config.n_predict)


@router.get("/props", response_model=Props)
async def props(server: Server):
    """llama-server's server properties: the default generation settings and the context length (n_ctx), how many
    requests generate at once, the model's path, name and chat template, and codespec's build."""
    engine, spec = server.engine, server.generations.spec
    return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": engine.context_length,
                                            "speculative": is_speculative(spec.spec), "is_processing": False,
                                            "params": default_params(server)},
            "total_slots": server.config.parallel, "model_path": server.model_path, "model_alias": server.model_name,
            "chat_template": chat_template(engine.tokenizer), "modalities": {"vision": False, "audio": False},
            "build_info": BUILD_INFO, "is_sleeping": False}


@router.get("/slots", response_model=list[Slot])
async def slots(request: Request, server: Server):
    """Every named session of this API key: its length, cached tokens, KV-cache bytes, and each drafter's
    statistics."""
    namespace, scheduler = tenant(request), server.scheduler

    def read(engine):
        busy = scheduler.busy_sessions()
        return [{"id": index, "session": info.id.removeprefix(namespace), "busy": info.id in busy,
                 "tokens": info.tokens, "cached": info.cached, "cache_bytes": info.cache_bytes, "spec": list(info.spec),
                 "drafters": [stats.to_dict() for stats in info.drafters], **llama_slot(info, info.id in busy)}
                for index, info in enumerate(engine.sessions_info(namespace))]

    def llama_slot(info, busy: bool) -> dict:  # llama-server's fields
        return {"n_ctx": server.engine.context_length, "is_processing": busy,
                "speculative": is_speculative(tuple(info.spec)),
                "params": {**default_params(server), "spec": list(info.spec)}}
    return await scheduler.acall(read)


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}})
async def prometheus(server: Server):
    def read(engine):
        return (len(engine.sessions_info()), engine.sessions_bytes(),
                max((pool.occupancy for pool in engine.shared.pools), default=0.0))
    count, total, occupancy = await server.scheduler.acall(read)
    metrics = server.metrics
    metrics.sessions.set(count)
    metrics.session_bytes.set(total)
    metrics.pool_occupancy.set(occupancy)
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
