"""Benchmark workloads built from the Python standard library's own source, present wherever Python is."""

from __future__ import annotations

import importlib
import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "edit" for now; completion, multi-turn and free-form come with the benchmark issue
    prompt: str
    chat: bool


# (module, qualified name, instruction): fixed choices so every run measures the same prompts
EDITS = [
    ("json.decoder", "py_scanstring", "renaming the variable `chunks` to `parts`"),
    ("heapq", "nlargest", "adding type hints to the signature"),
    ("statistics", "linear_regression", "renaming the parameter `proportional` to `through_origin`"),
]


def stdlib_source(module: str, qualname: str) -> str:
    target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return textwrap.dedent(inspect.getsource(target))


def edit_workloads(count: int = 1) -> list[Workload]:
    workloads = []
    for module, qualname, change in EDITS[:count]:
        source = stdlib_source(module, qualname)
        prompt = (f"Rewrite this Python function from `{module}`, {change}. "
                  f"Reply with the complete function only.\n\n```python\n{source}```")
        workloads.append(Workload(f"edit:{qualname}", "edit", prompt, chat=True))
    return workloads
