"""Settings from initializationOptions and workspace/didChangeConfiguration, checked key by key: a bad value
is reported and skipped, so one typo in an editor's config never takes the other settings down with it."""

from __future__ import annotations

import re
from dataclasses import fields, replace

from codespec.config import DRAFT_MAX_LIMIT, SpecConfig, unknown_drafters

from .protocol import SETTINGS_SECTION, Settings

LIMITS = {  # name -> (lowest, highest)
    "draft_max": (1, DRAFT_MAX_LIMIT), "max_tokens": (1, 4096), "command_max_tokens": (1, 8192),
    "debounce_ms": (0, 5000), "prefix_tokens": (16, 32768), "suffix_tokens": (0, 8192), "extra_tokens": (0, 32768),
    "max_file_chars": (1, 1 << 30),
}


def snake_case(name: str) -> str:
    """draftMax and draft-max both mean draft_max (editors write settings in camelCase)."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).replace("-", "_").lower()


def section(options) -> dict | None:
    """The codespec settings inside initializationOptions or a didChangeConfiguration payload: under the
    "codespec" key, or the object itself when it already holds settings names."""
    if not isinstance(options, dict):
        return None
    inner = options.get(SETTINGS_SECTION)
    if isinstance(inner, dict):
        return inner
    names = {f.name for f in fields(Settings)}
    return options if any(snake_case(key) in names for key in options) else None


def apply(current: Settings, values: dict) -> tuple[Settings, list[str]]:
    """`current` updated with the valid keys of `values`, and one problem line per key that was skipped."""
    known = {f.name: f for f in fields(Settings)}
    updates, problems = {}, []
    for key, value in values.items():
        name = snake_case(key)
        if name not in known:
            problems.append(f"unknown setting {key!r}")
            continue
        problem = check(name, value, getattr(current, name))
        if problem:
            problems.append(f"setting {key!r}: {problem}")
            continue
        updates[name] = list(value) if isinstance(value, list) else value
    return replace(current, **updates), problems


def check(name: str, value, default) -> str | None:
    if isinstance(default, list):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return "must be a list of drafter names"
        return unknown_drafters(tuple(value))
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, got {value!r}"
        low, high = LIMITS.get(name, (0, 1 << 62))
        return None if low <= value <= high else f"must be in {low}..{high}, got {value}"
    if not isinstance(value, str) or not value:
        return f"must be a non-empty string, got {value!r}"
    return None


def spec_config(settings: Settings, command: bool = False) -> SpecConfig:
    return SpecConfig(spec=tuple(settings.command_spec if command else settings.spec), draft_max=settings.draft_max)
