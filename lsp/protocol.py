"""The one protocol schema: every custom method, command id, argument shape and setting that codespec's
language server speaks beyond standard LSP.

The server and the tests import this module; the editor clients read `editors/protocol.json`, which is
generated from it (`python -m lsp.protocol > editors/protocol.json`) and checked by a test, so a client that
disagrees with the server fails CI instead of failing in the editor.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields

from codespec.config import DEFAULT_MODEL, SpecConfig

SERVER_NAME = "codespec"
SETTINGS_SECTION = "codespec"  # workspace/configuration section and initializationOptions key


@dataclass(frozen=True)
class Argument:
    name: str
    type: str  # JSON type: "string", "object" (an LSP Range), ...
    doc: str


@dataclass(frozen=True)
class Command:
    """A refactoring command: offered as a code action on a selection, run with workspace/executeCommand
    whose single argument is an object with these fields; the server answers with workspace/applyEdit."""

    id: str
    title: str
    arguments: tuple[Argument, ...]
    prompt: str | None = None  # the client asks the user for the last argument with this prompt


URI = Argument("uri", "string", "the document")
RANGE = Argument("range", "object", "the selection, an LSP Range (UTF-16 positions)")

REWRITE_SELECTION = Command(
    "codespec.rewriteSelection", "codespec: rewrite selection",
    (URI, RANGE, Argument("instruction", "string", "what to change, in plain words")),
    prompt="Rewrite instruction")
ADD_DOCSTRINGS = Command("codespec.addDocstrings", "codespec: add docstrings", (URI, RANGE))
ADD_TYPE_HINTS = Command("codespec.addTypeHints", "codespec: add type hints", (URI, RANGE))
TRANSLATE_COMMENTS = Command(
    "codespec.translateComments", "codespec: translate comments",
    (URI, RANGE, Argument("language", "string", "the language to translate comments into")),
    prompt="Translate comments into")

COMMANDS = (REWRITE_SELECTION, ADD_DOCSTRINGS, ADD_TYPE_HINTS, TRANSLATE_COMMENTS)
COMMANDS_BY_ID = {command.id: command for command in COMMANDS}

# Server -> client notification after each completion or command: what speculation did.
STATS_NOTIFICATION = "codespec/stats"


@dataclass
class Stats:
    """Params of codespec/stats."""

    kind: str  # "completion" or a command id
    generated_tokens: int
    tokens_per_second: float
    tokens_per_forward: float
    acceptance: float  # accepted draft tokens / drafted tokens, 0 when nothing was drafted
    prompt_tokens: int = 0  # tokens in the prompt
    cached_tokens: int = 0  # of those, tokens the session's KV cache already held (not prefilled again)
    seconds: float = 0.0  # generation time, prefill included
    prefill_seconds: float = 0.0  # time to the first token
    precomputed: bool = False  # answered from accept-ahead: computed while the accepted suggestion was on screen


@dataclass
class Settings:
    """initializationOptions[SETTINGS_SECTION] and workspace/didChangeConfiguration settings[SETTINGS_SECTION].
    Every key is optional; a missing one keeps its current value."""

    model: str = DEFAULT_MODEL  # the model to load (only read at start: a running server keeps its model)
    spec: list[str] = field(default_factory=lambda: list(SpecConfig().spec))  # drafter chain (config.py's)
    draft_max: int = SpecConfig().draft_max  # longest draft (config.py's)
    max_tokens: int = 128  # longest inline completion
    command_max_tokens: int = 1024  # longest refactoring output
    debounce_ms: int = 150  # wait this long after the last keystroke before completing
    # drafter chain for refactoring commands: the edit-aligned drafter first (long drafts over the unchanged
    # parts of the selection), then the shared pool and the prompt
    command_spec: list[str] = field(default_factory=lambda: ["edit-align", "ngram-mod", "prompt-lookup"])
    prefix_tokens: int = 1024  # the current file before the cursor, at most (prefill costs ~1 ms a token on a CPU)
    suffix_tokens: int = 256  # the current file after the cursor, at most
    extra_tokens: int = 512  # chunks of other open and recently edited files, at most
    max_file_chars: int = 1_000_000  # larger documents get no completions and feed no context


def _json_type(python_type) -> str:
    name = python_type if isinstance(python_type, str) else python_type.__name__
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
        name.split("[")[0], "array" if name.startswith("list") else "string")


def _default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def schema() -> dict:
    """The protocol as JSON data for the editor clients."""
    return {
        "server": SERVER_NAME,
        "settingsSection": SETTINGS_SECTION,
        "commands": [{"id": c.id, "title": c.title, "prompt": c.prompt,
                      "arguments": [{"name": a.name, "type": a.type, "doc": a.doc} for a in c.arguments]}
                     for c in COMMANDS],
        "notifications": {"stats": {"method": STATS_NOTIFICATION,
                                    "params": [f.name for f in fields(Stats)]}},
        "settings": [{"name": f.name, "type": _json_type(f.type), "default": _default(f)} for f in fields(Settings)],
    }


if __name__ == "__main__":
    print(json.dumps(schema(), indent=2))
