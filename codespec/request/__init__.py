"""The request layer below both frontends (HTTP routes, language server): prompt -> session -> job with chunked
prefill, temporary sessions, output limits as one filter, the engine's statistics (run.py, limits.py)."""

from .limits import EDITOR, LLAMA_CPP, BlockLimit, BlockRule, OutputFilter, TimeLimit, apply_limits
from .run import Prompt, Request, Requests, Run

__all__ = ["EDITOR", "LLAMA_CPP", "BlockLimit", "BlockRule", "OutputFilter", "Prompt", "Request", "Requests", "Run",
           "TimeLimit", "apply_limits"]
