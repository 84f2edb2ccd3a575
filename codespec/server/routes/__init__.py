"""The server's routes as APIRouters: llama.cpp's generation routes (llama.py), OpenAI's (openai.py), llama-server's
tokenizer routes (tokens.py), and what the server tells about itself: health, models, props, slots, metrics
(admin.py); common.py has what the generation routes share. A route reaches the app's scheduler, metrics and
generations through its `Server` parameter (state.py).

llama-server's aliases (ALIASES) are the same handlers under a second path, for clients given a base URL without
/v1 (llama.vscode's, tools that append /chat/completions): left out of the OpenAPI document, which lists each
handler once."""

from fastapi import APIRouter
from fastapi.routing import APIRoute

from . import admin, llama, openai, tokens

ALIASES = {"/completions": "/v1/completions", "/chat/completions": "/v1/chat/completions", "/models": "/v1/models",
           "/v1/health": "/health"}


def alias_router(routers, aliases: dict[str, str]) -> APIRouter:
    """A router with each alias path served by its route's own handler, methods and response model."""
    routes = {route.path: route for router in routers for route in router.routes if isinstance(route, APIRoute)}
    router = APIRouter()
    for alias, path in aliases.items():
        route = routes[path]
        router.add_api_route(alias, route.endpoint, methods=sorted(route.methods), response_model=route.response_model,
                             responses=route.responses, response_class=route.response_class,
                             name=f"{route.name} ({alias})", include_in_schema=False)
    return router


_HANDLERS = (llama.router, openai.router, tokens.router, admin.router)  # in this order: the OpenAPI document lists
ROUTERS = (*_HANDLERS, alias_router(_HANDLERS, ALIASES))                # them so

__all__ = ["ALIASES", "ROUTERS"]
