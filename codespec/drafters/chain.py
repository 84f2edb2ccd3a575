"""A chain of drafters: the first non-empty draft wins (a tentative one only when no drafter after it drafts);
every drafter hears every event and is timed."""

from __future__ import annotations

import time

import numpy as np

from ..config import SamplingParams
from ..stats import DrafterStats
from .base import Draft, Drafter


class Chain:
    def __init__(self, drafters: list[Drafter], draft_min: int = 1):
        self.drafters = drafters
        self.draft_min = draft_min
        self.stats = [DrafterStats(name=d.name) for d in drafters]
        self._last: int | None = None  # index of the drafter whose draft is being verified
        self.called: list[tuple[str, float]] = []  # the last draft()'s calls: (drafter, seconds), in chain order
        self.reach = 0  # the longest draft a drafter that follows this generation's reference may make (0: draft_max)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.drafters)

    def begin(self, history: np.ndarray, params: SamplingParams) -> None:
        for drafter, stats in zip(self.drafters, self.stats):
            started = time.perf_counter()
            drafter.begin(history, params)
            stats.begin_s += time.perf_counter() - started

    def draft(self, history: np.ndarray, max_tokens: int, limit=None, room: int | None = None) -> Draft | None:
        """The first draft of at least draft_min tokens that is not tentative, else the first tentative one.
        limit(name, max_tokens), when given, caps what one drafter may draft (0: skip it) — adaptive speculation's
        say on drafters whose drafting is costly. room: the most tokens the step can take, up to which a drafter
        that follows the reference drafts (self.reach; None: max_tokens)."""
        self._last = None
        self.called = []
        longest = min(max(max_tokens, self.reach), max_tokens if room is None else room)
        fallback: tuple[int, Draft] | None = None
        for index, (drafter, stats) in enumerate(zip(self.drafters, self.stats)):
            most = longest if drafter.follows_reference else max_tokens
            if most < self.draft_min:  # no room for a draft this long
                continue
            allowed = limit(drafter.name, most) if limit is not None else most
            if allowed < self.draft_min:  # held back: adaptive speculation judged its drafting would not pay
                stats.skipped_drafts += 1
                continue
            started = time.perf_counter()
            proposal = drafter.draft(history, allowed)
            seconds = time.perf_counter() - started
            self.called.append((drafter.name, seconds))
            stats.draft_s += seconds
            stats.calls += 1
            if proposal is not None and len(proposal.tokens) >= self.draft_min:
                proposal.tokens = proposal.tokens[:allowed]
                if not proposal.tentative:
                    self._last = index
                    return proposal
                fallback = fallback or (index, proposal)
        if fallback is not None:
            self._last = fallback[0]
            return fallback[1]
        return None

    @property
    def last(self) -> str | None:
        """The name of the drafter whose draft is being verified."""
        return self.drafters[self._last].name if self._last is not None else None

    def accept(self, history: np.ndarray, drafted: int, accepted: int) -> None:
        """The target verified `drafted` tokens of the last draft (0: the draft was held back) and
        accepted `accepted` of them."""
        for index, (drafter, stats) in enumerate(zip(self.drafters, self.stats)):
            own = index == self._last
            if own:
                stats.gen_drafts += drafted > 0
                stats.skipped_drafts += drafted == 0
                stats.gen_tokens += drafted
                stats.acc_tokens += accepted
                stats.acc_drafts += accepted > 0
            started = time.perf_counter()
            drafter.accept(history, drafted if own else 0, accepted if own else 0)
            stats.accept_s += time.perf_counter() - started
        self._last = None

    def set_reference(self, tokens: list[int] | None, reach: int = 0) -> None:
        """The text the next generation rewrites (None: an ordinary generation), and the longest draft a drafter
        that follows it may make (0: draft_max, as every drafter)."""
        for drafter in self.drafters:
            drafter.set_reference(tokens)
        self.reach = reach if tokens else 0

    def truncate(self, new_len: int) -> None:
        for drafter, stats in zip(self.drafters, self.stats):
            started = time.perf_counter()
            drafter.truncate(new_len)
            stats.accept_s += time.perf_counter() - started
