"""Benchmark workloads built from the Python standard library's own source, present wherever Python is.

Every choice is fixed (module, function, cut point), so every run and every machine measures the
same prompts. Five classes:
  edit        a chat request to rewrite a function with a small change: output repeats the input
  completion  continue a module from a cut point inside a function (prefix only: the default
              model's tokenizer has no fill-in-the-middle tokens)
  multi-turn  five successive edits of one function in one session: prefix reuse and the pool matter
  free-form   explain code or write prose: little to copy, so speculation must not cost anything
  prose       questions whose answers the default model writes with few repeats (about 1 token in 5
              continues an earlier 3-gram, against 1 in 3 or more for free-form): where drafts mostly fail,
              speculation must switch itself off
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "edit", "completion", "multi-turn", "free-form" or "prose"
    turns: tuple[str, ...]  # user messages, in order (chat), or one raw prompt (completion)
    chat: bool = True


@dataclass
class Run:
    """One workload's generation by one configuration (codespec's, transformers' or llama-server's), all turns."""

    seconds: float
    tokens: list[int]
    forwards: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    prefill_seconds: float = 0.0  # time to each turn's first token: the same work for every config
    turns: int = 0
    outside_forwards: float = 0.0  # seconds outside target forwards (codespec configs)
    server: dict | None = None  # llama-server's own timings, summed over turns (prompt_n/_ms, predicted_n/_ms)

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.prefill_seconds

    @property
    def decode_tokens(self) -> int:
        return len(self.tokens) - self.turns  # each turn's first token comes with its prefill


# (module, qualified name, change): fixed choices
EDITS = [
    ("json.decoder", "py_scanstring", "renaming the variable `chunks` to `parts`"),
    ("heapq", "nlargest", "adding type hints to the signature"),
    ("statistics", "linear_regression", "renaming the parameter `proportional` to `through_origin`"),
    ("shlex", "shlex.read_token", "translating every comment into French"),
    ("textwrap", "TextWrapper._split", "adding a docstring"),
]
COMPLETIONS = [("textwrap", "TextWrapper._wrap_chunks"), ("argparse", "ArgumentParser._get_values")]
MULTI_TURN = ("heapq", "nsmallest", [
    "rename the variable `result` to `smallest`",
    "add type hints to the signature",
    "add a docstring that explains the parameters",
    "replace the comments with shorter ones",
    "rename the parameter `iterable` to `items`",
])
FREE_FORM = [
    "Explain, in three paragraphs, how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper who learns to program.",
]

# chosen by measurement: greedy SmolLM2-135M output continues an earlier 3-gram of prompt or output for 17%,
# 25% and 14% of its tokens (free-form's story and letter prompts: 31-51%)
PROSE = [
    "What are the main causes of inflation, and how do central banks respond? Answer in plain language.",
    "Tell me about the history of the printing press and how it changed Europe.",
    "Give three pieces of advice for someone learning to cook, each with a different reason.",
]


def stdlib_source(module: str, qualname: str) -> str:
    target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return textwrap.dedent(inspect.getsource(target))


def edit_request(module: str, qualname: str, change: str) -> str:
    return (f"Rewrite this Python function from `{module}`, {change}. Reply with the complete function only."
            f"\n\n```python\n{stdlib_source(module, qualname)}```")


def edit_workloads(count: int = 1) -> list[Workload]:
    return [Workload(f"edit:{qualname.split('.')[-1]}", "edit", (edit_request(module, qualname, change),))
            for module, qualname, change in EDITS[:count]]


def completion_workloads(count: int = 1) -> list[Workload]:
    workloads = []
    for module, qualname in COMPLETIONS[:count]:
        source = inspect.getsource(importlib.import_module(module))
        start = source.index(stdlib_source(module, qualname).splitlines()[0].strip())
        body = stdlib_source(module, qualname)
        cut = start + len(body) // 2  # halfway through the function, so the rest is predictable but not given
        prefix = source[max(0, cut - 4000) : cut]  # the last ~4k characters before the cut
        workloads.append(Workload(f"completion:{qualname.split('.')[-1]}", "completion", (prefix,), chat=False))
    return workloads


def multi_turn_workload() -> Workload:
    module, qualname, changes = MULTI_TURN
    first = edit_request(module, qualname, changes[0])
    later = tuple(f"Now also {change}. Reply with the complete function only." for change in changes[1:])
    return Workload(f"multi-turn:{qualname}", "multi-turn", (first, *later))


def free_form_workloads(count: int = 1) -> list[Workload]:
    return [Workload(f"free-form:{i}", "free-form", (prompt,)) for i, prompt in enumerate(FREE_FORM[:count])]


def prose_workloads(count: int = 1) -> list[Workload]:
    return [Workload(f"prose:{i}", "prose", (prompt,)) for i, prompt in enumerate(PROSE[:count])]


def all_workloads(per_class: int = 1) -> list[Workload]:
    return [*edit_workloads(per_class), *completion_workloads(per_class), multi_turn_workload(),
            *free_form_workloads(per_class), *prose_workloads(per_class)]
