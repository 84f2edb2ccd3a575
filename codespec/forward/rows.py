"""What a forward reads and writes: one sequence's share of it (`Rows`) and a session's KV cache (`StaticCache`).
Every path (lean.py, graphs.py) and the kernels take these."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from .kernels import attention


@dataclass
class Rows:
    """One sequence's share of a forward: `ids` at positions cache.length.., logits for the last `keep`."""

    cache: object
    ids: list[int]
    keep: int
    generating: bool = False  # the forward yields a token for it (not a prefill chunk)
    prompt: bool = False  # a chunk of a prompt: its projections may run in bfloat16 (LeanLlama.prompt_weights)
    seconds: float = 0.0  # how long the forward it was part of took, once it ran
    targets: Optional[list[int]] = None  # the argmax of each kept row, where the path took it (graphs.py)


class StaticCache:
    """Keys and values for every layer: [layers, kv_heads, capacity, head_dim] each, written by position.
    Grows by doubling when a forward needs more room; `crop` only moves the length."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        # q8 (int8): each key's or value's head_dim integers, then its float32 scale as 4 bytes
        self.shape = (layers, kv_heads, capacity, head_dim + 4 if dtype == torch.int8 else head_dim)
        self.keys = torch.zeros(self.shape, dtype=dtype, device=device)
        self.values = torch.zeros(self.shape, dtype=dtype, device=device)
        self.length = 0
        self.laid = None  # prompt_attention.Laid: the keys and values as its tiles read them, while a prompt runs
        self._leader: Optional[weakref.ref] = None  # a cache whose first _shared positions hold these bits too
        self._shared = 0
        self._followers: weakref.WeakSet = weakref.WeakSet()  # caches that read a prefix from this one

    @property
    def capacity(self) -> int:
        return self.shape[2]

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        layers, heads, capacity, head_dim = self.shape
        # a multiple of 16: attention's tiles read keys 16 at a time
        self.shape = (layers, heads, attention.padded_width(max(needed, 2 * capacity)), head_dim)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros(self.shape)
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def stretch(self, length: int) -> None:
        """Positions up to `length` filled with copies of the cached ones, over and over: as many keys as a cache of
        that length holds, without the forwards that would compute them (adaptive.measure_costs times forwards over
        caches of some lengths, and the kernels read every key whatever it holds)."""
        self.reserve(length)
        start = self.length
        while self.length < length:
            count = min(start, length - self.length)
            for held in (self.keys, self.values):
                held[:, :, self.length : self.length + count] = held[:, :, :count]
            self.length += count
        self.changed(start)

    def crop(self, new_len: int) -> None:
        self.length = min(self.length, new_len)
        self.changed(new_len)

    def changed(self, position: int) -> None:
        """Positions from `position` on are rewritten (a crop, or keys and values moved there)."""
        if self.laid is not None:
            self.laid.changed(position)
        self._shared = min(self._shared, position)
        for follower in list(self._followers):  # what they read from here is no longer theirs past it
            follower._shared = min(follower._shared, position)

    def follow(self, leader: "StaticCache", count: int) -> None:
        """This cache's first `count` positions were copied from `leader`'s (Session.fork): until either rewrites
        one of them (`changed`), the attention kernel may read them from the leader, so that alternatives of one
        prompt stream one copy of its keys and values, not one each."""
        if leader.shape[0:2] != self.shape[0:2] or leader.keys.dtype != self.keys.dtype or leader is self:
            return
        self._leader, self._shared = weakref.ref(leader), count
        leader._followers.add(self)

    def shared_prefix(self) -> Optional[tuple["StaticCache", int]]:
        """(the leader, positions to read from it: a multiple of 16, within both lengths), or None."""
        leader = self._leader() if self._leader is not None else None
        count = min(self._shared, self.length, leader.length if leader is not None else 0) // 16 * 16
        return (leader, count) if count > 0 else None

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + (self.laid.nbytes if self.laid is not None else 0)
