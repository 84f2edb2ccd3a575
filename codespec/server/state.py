"""What the routes share: one ServerState per app, on `app.state.server`, which a route asks for as a `Server`
parameter (a FastAPI dependency) instead of closing over create_app's locals."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from ..config import ServerConfig
from ..scheduler import Scheduler
from .errors import UnknownModel
from .generation import Generations
from .metrics import Metrics

if TYPE_CHECKING:
    from ..engine import Engine


@dataclass(frozen=True)
class ServerState:
    """One app's engine and what serves it: the scheduler that owns the engine, the metrics, the routes'
    generations, and the model's names."""

    config: ServerConfig
    engine: Engine
    scheduler: Scheduler
    metrics: Metrics
    generations: Generations
    costs: Future  # the adaptive cost table, computed on the worker at start-up
    model_name: str  # the id /v1/models lists
    known_models: frozenset[str]  # the names a request's `model` may give: model_name and its aliases
    model_path: str = ""  # what the model was loaded from (llama-server's /props model_path)

    def check_model(self, name: str | None) -> None:
        """OpenAI answers 404 for a model it does not serve; no name or "" (llama.vim's default) is this one."""
        if name and name not in self.known_models:
            raise UnknownModel(name)


async def server_state(request: Request) -> ServerState:
    """The app's ServerState (async: a plain function would run in the thread pool)."""
    return request.app.state.server


Server = Annotated[ServerState, Depends(server_state)]
