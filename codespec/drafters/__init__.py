"""Drafters, by the names `--spec` accepts, and what sessions share between them."""

from __future__ import annotations

from ..config import DRAFTLESS_FIRST, SpecConfig
from .base import Draft, Drafter
from .chain import Chain
from .ngram_mod import NgramMod, NgramPool
from .none import NoDrafter
from .prompt_lookup import PromptLookup


class SharedDrafting:
    """What every session of one engine shares: the ngram-mod pool (one per pool setting, so a
    request that asks for another n or size gets its own), the static n-gram cache, the draft model."""

    def __init__(self):
        self.pools: dict[tuple, NgramPool] = {}

    def pool(self, spec: SpecConfig) -> NgramPool:
        key = (spec.mod_pool_size, spec.mod_n, spec.mod_reset_occupancy, spec.mod_reset_low_rounds,
               spec.mod_reset_acceptance)
        if key not in self.pools:
            self.pools[key] = NgramPool(spec.mod_pool_size, spec.mod_n, spec.mod_reset_occupancy,
                                        spec.mod_reset_low_rounds, spec.mod_reset_acceptance)
        return self.pools[key]


def build_drafter(name: str, spec: SpecConfig, shared: SharedDrafting) -> Drafter:
    if name == "none":
        return NoDrafter()
    if name == "prompt-lookup":
        return PromptLookup(spec.ngram_min, spec.ngram_max)
    if name == "ngram-mod":
        return NgramMod(shared.pool(spec))
    raise ValueError(f"unknown drafter {name!r}")


def build_chain(spec: SpecConfig, shared: SharedDrafting | None = None) -> Chain:
    """Drafters in the order given, except that model drafters go last: the first non-empty draft
    wins, so the cheap draftless ones are asked first and a draft model is the fallback."""
    spec.validate()
    shared = shared or SharedDrafting()
    order = sorted(spec.spec, key=lambda name: name in DRAFTLESS_FIRST)
    return Chain([build_drafter(name, spec, shared) for name in order], draft_min=spec.draft_min)


__all__ = ["Chain", "Draft", "Drafter", "SharedDrafting", "build_chain", "build_drafter"]
