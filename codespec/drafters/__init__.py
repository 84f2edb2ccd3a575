"""Drafters, by the names `--spec` accepts."""

from __future__ import annotations

from ..config import SpecConfig
from .base import Draft, Drafter
from .chain import Chain
from .none import NoDrafter
from .prompt_lookup import PromptLookup


def build_drafter(name: str, spec: SpecConfig) -> Drafter:
    if name == "none":
        return NoDrafter()
    if name == "prompt-lookup":
        return PromptLookup(spec.ngram_min, spec.ngram_max)
    raise ValueError(f"unknown drafter {name!r}")


def build_chain(spec: SpecConfig) -> Chain:
    spec.validate()
    return Chain([build_drafter(name, spec) for name in spec.spec], draft_min=spec.draft_min)


__all__ = ["Chain", "Draft", "Drafter", "build_chain", "build_drafter"]
