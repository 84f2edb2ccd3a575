"""The HTTP server (`codespec serve`): FastAPI routes over one scheduler that owns the engine."""

from .app import create_app
from .serving import uvicorn_options

__all__ = ["create_app", "uvicorn_options"]
