"""Drafters, by the names `--spec` accepts, and what sessions share between them."""

from __future__ import annotations

from ..config import MODEL_DRAFTERS, ModelConfig, SpecConfig
from ..errors import CodespecError
from ..forward import forward_path
from .base import Draft, Drafter
from .chain import Chain
from .draft_model import DraftModel, check_compatible, truncated_copy
from .edit_align import EditAlign
from .ngram_cache import NgramCache, StaticCache, load_static_cache
from .ngram_map import NgramMap, NgramMapK4V
from .ngram_mod import NgramMod, NgramPool
from .none import NoDrafter
from .prompt_lookup import PromptLookup


def warm() -> None:
    """Load (or compile, once per machine) the drafters' numba code on tiny inputs, so that no request pays for it
    and the first calls' timings (adaptive speculation prices each drafter's calls) are what a call costs."""
    import numpy as np

    history = np.arange(40, dtype=np.int64) % 7
    pool = NgramPool(size=1024, n=4)
    view = NgramMod(pool)
    view.begin(history, None)
    view.draft(history, 4)
    view.truncate(10)
    PromptLookup().draft(history, 4)


class SharedDrafting:
    """What every session of one engine shares: the one ngram-mod pool (its settings are the engine's, whatever a
    request's spec says: every frontend of a process drafts from and teaches the same pool), and, built once on
    first use, static n-gram caches and draft models with their forward paths."""

    def __init__(self, target=None, tokenizer=None, spec: SpecConfig | None = None):
        self.target, self.tokenizer = target, tokenizer
        self.pool_settings = (spec or SpecConfig()).pool_settings()
        self._pool: NgramPool | None = None  # built on first use: 32 MB that a pool-less chain never needs
        self.static_caches: dict[str, StaticCache] = {}
        self.draft_models: dict[tuple, object] = {}
        self.draft_paths: dict[tuple, object] = {}

    @property
    def pool(self) -> NgramPool:
        if self._pool is None:
            settings = {name.removeprefix("mod_"): value for name, value in self.pool_settings.items()}
            self._pool = NgramPool(settings.pop("pool_size"), **settings)
        return self._pool

    @property
    def pools(self) -> list[NgramPool]:
        """The pools built so far (none until a session drafts from it)."""
        return [self._pool] if self._pool is not None else []

    def static_cache(self, path: str | None) -> StaticCache | None:
        if path is None:
            return None
        if path not in self.static_caches:
            try:
                self.static_caches[path] = load_static_cache(path)
            except (OSError, ValueError) as exc:
                raise CodespecError(f"cannot load n-gram cache: {exc}") from None
        return self.static_caches[path]

    def draft_model(self, spec: SpecConfig):
        key = (spec.draft_model, spec.draft_layers)
        if key not in self.draft_models:
            if self.target is None:
                raise CodespecError("a draft model needs the engine's target model")
            if spec.draft_layers:
                self.draft_models[key] = truncated_copy(self.target, spec.draft_layers)
            else:
                from ..forward.models import load

                dtype = str(self.target.dtype).removeprefix("torch.")
                model, tokenizer = load(ModelConfig(model=spec.draft_model, device=str(self.target.device),
                                                    dtype=dtype), show_progress=False)
                check_compatible(self.tokenizer, tokenizer)
                self.draft_models[key] = model
        return self.draft_models[key]

    def draft_path(self, spec: SpecConfig):
        """The draft model's forward, built once: the lean path packs its weights, which takes a while."""
        key = (spec.draft_model, spec.draft_layers)
        if key not in self.draft_paths:
            self.draft_paths[key] = forward_path(self.draft_model(spec))
        return self.draft_paths[key]


def build_drafter(name: str, spec: SpecConfig, shared: SharedDrafting) -> Drafter:
    if name == "none":
        return NoDrafter()
    if name == "prompt-lookup":
        return PromptLookup(spec.ngram_min, spec.ngram_max)
    if name == "ngram-mod":
        return NgramMod(shared.pool)
    if name == "edit-align":
        return EditAlign()
    if name == "ngram-map-k":
        return NgramMap(spec.map_n, spec.map_m, spec.map_min_hits)
    if name == "ngram-map-k4v":
        return NgramMapK4V(spec.map_n, spec.map_m, spec.map_min_hits)
    if name == "ngram-cache":
        return NgramCache(static=shared.static_cache(spec.ngram_cache), n_max=spec.cache_n_max)
    if name == "draft":
        target_vocab = shared.target.config.vocab_size if shared.target is not None else None
        return DraftModel(shared.draft_model(spec), spec.draft_p_min, target_vocab_size=target_vocab,
                          path=shared.draft_path(spec))
    raise ValueError(f"unknown drafter {name!r}")


def build_chain(spec: SpecConfig, shared: SharedDrafting | None = None) -> Chain:
    """Drafters in the order given, except that model drafters go last: the first non-empty draft
    wins, so the cheap draftless ones are asked first and a draft model is the fallback."""
    shared = shared or SharedDrafting()
    order = sorted(spec.spec, key=lambda name: name in MODEL_DRAFTERS)
    return Chain([build_drafter(name, spec, shared) for name in order], draft_min=spec.draft_min)


__all__ = ["Chain", "Draft", "Drafter", "SharedDrafting", "build_chain", "build_drafter"]
