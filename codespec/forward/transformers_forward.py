"""transformers' own forward, for what the lean forward does not run (other architectures, --forward transformers),
with transformers' cache built so that a rollback works on every layer type. Its own module, imported where it
runs: transformers takes ~1 s to import, and a GGUF read directly never needs it."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

from .rows import Rows


class TransformersCache(DynamicCache):
    """transformers' own cache, built so that `crop(n)` keeps its promise for every n.

    transformers gives sliding-window (and chunked) attention layers a cache that keeps only the window, which
    cannot be rolled back once full: the first rejected draft past the window would raise. Here those layers
    keep their whole history like any other attention layer; the model's attention mask still limits each one
    to its window, so the logits are the same. The price is memory: the full context on those layers too.

    Layers with recurrent state (linear attention, convolutions) cannot be rolled back at all. For such a model
    `rewindable` is False and a crop below the length empties the cache, so the session computes its history
    again: still correct, but every rejected draft would cost a whole prefill, so the engine does not speculate
    on such a model (Engine.session)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.config = config
        self.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                       for layer in self.layers]
        self.rewindable = all(type(layer) in (DynamicLayer, DummyLayer) for layer in self.layers)

    @property
    def length(self) -> int:
        return int(self.get_seq_length())  # (a tensor for some layer types: LFM2's, in transformers 5.25)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in (getattr(layer, "keys", None),
                                                               getattr(layer, "values", None))
                   if isinstance(t, torch.Tensor))

    def crop(self, new_len: int) -> None:
        if new_len >= self.length:
            return
        if self.rewindable:
            super().crop(new_len - self.length)  # transformers 5: a negative count removes that many
        else:  # state that cannot be taken back: start again (the session re-feeds history[:new_len])
            self.layers = TransformersCache(self.config).layers


class TransformersForward:
    """The model's own forward; any architecture transformers runs as a causal LM with a cache."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.rewindable = self.new_cache().rewindable

    def new_cache(self) -> TransformersCache:
        return TransformersCache(self.model.config)

    @torch.no_grad()
    def __call__(self, cache: TransformersCache, input_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.model.device)  # [1, q]
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
        return out.logits[0]

    def batch(self, rows: list[Rows]) -> list[torch.Tensor]:
        """One forward per sequence: transformers' caches of different lengths do not stack without padding
        every row and mask, which most architectures' cache classes do not support for rollback."""
        return [self(r.cache, r.ids, r.keep) for r in rows]
