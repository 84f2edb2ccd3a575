"""The server's routes as APIRouters: llama.cpp's generation routes (llama.py), OpenAI's (openai.py), and what the
server tells about itself: health, models, slots, metrics (admin.py); common.py has what the generation routes
share. A route reaches the app's scheduler, metrics and generations through its `Server` parameter (state.py)."""

from . import admin, llama, openai

ROUTERS = (llama.router, openai.router, admin.router)  # in this order: the OpenAPI document lists them so

__all__ = ["ROUTERS"]
