"""A session: one token history and the KV cache that covers it.

Invariant between steps: the cache holds keys/values for history[:cached]; the tokens after that
(`pending`, at least one) are fed with the next forward. Editors resend nearly the same prompt on every
keystroke, so a new prompt keeps the longest common prefix and prefills only the rest.
"""

from __future__ import annotations

import numpy as np

from .drafters import Chain
from .drafters.base import common_prefix
from .forward import Rows


class Session:
    def __init__(self, path, chain: Chain, session_id: str | None = None):
        """path: the target forward (forward.py), shared by all sessions; each session has its own cache."""
        self.id = session_id
        self.path = path
        self.chain = chain
        self.spec = None  # the SpecConfig the chain was built from
        self.cache = path.new_cache()
        self.adaptive = None  # acceptance evidence per drafter, set by the engine (adaptive.py)
        self.reuse_min = 0  # > 0: reuse cached chunks of at least this many tokens at shifted positions
        self.donors = None  # with reuse_min: () -> the sessions whose caches it may borrow chunks from (Engine.session)
        self._tokens = np.zeros(1024, dtype=np.int64)
        self.length = 0

    @property
    def history(self) -> np.ndarray:
        view = self._tokens[: self.length]
        view.flags.writeable = False
        return view

    @property
    def cached(self) -> int:
        return self.cache.length

    @property
    def nbytes(self) -> int:
        """The memory this session holds: its KV cache and its history."""
        return self.cache.nbytes + self._tokens.nbytes

    @property
    def pending(self) -> list[int]:
        return self._tokens[self.cached : self.length].tolist()

    def prepare(self, prompt: list[int]) -> int:
        """Make the history equal to `prompt`, reusing the common prefix (and, with reuse_min, cached chunks further
        on: reuse_chunks); return the prompt tokens whose keys and values came from the cache."""
        common = common_prefix(self.history, prompt)
        moves = self.reuse_chunks(prompt, common) if self.reuse_min > 0 and common < self.cached else []
        if self.reuse_min > 0 and self.donors is not None:
            plan = self.borrowing(prompt, common, min(common, self.cached) + sum(count for *_, count in moves))
            if plan:
                return self.borrow(prompt, common, plan)
        if common < self.length:
            self.truncate(common)  # the history was rewritten: tell the drafters
        computed = 0
        for source, target, count in moves:
            self.path.move(self.cache, source, target, count)  # into place first: a gap's forward stops before it
            if target > self.cache.length:  # a few prompt tokens the cache never held (a re-split line start)
                computed += target - self.cache.length
                self.path(self.cache, prompt[self.cache.length : target], 1)
            self.cache.length = target + count
        self.append(prompt[common:])
        # at least the last prompt token must be fed, to get the logits for the first new token
        self.crop_cache(min(self.cached, len(prompt) - 1))
        return self.cached - computed

    MAX_GAP = 8  # prompt tokens a reused chunk may start after: a line that now starts the window is split anew

    def reuse_chunks(self, prompt: list[int], common: int) -> list[tuple[int, int, int]]:
        """llama-server's --cache-reuse: runs of at least reuse_min cached tokens that the new prompt holds at the
        same or an earlier position (lines scrolled out of a sliding window, a deleted block above the cursor) are
        moved into place instead of computed again. A run may start up to MAX_GAP prompt tokens after the last
        one ends (the line that now opens the window tokenises differently without the newline before it); those
        few are computed. Returns (source, target, count) moves in order, each moving left or staying.
        An approximation, as in llama-server: a moved token's keys and values in the deeper layers still reflect
        the text that preceded it in the old prompt, so the output can differ from a cold prefill."""
        if not hasattr(self.path, "move"):
            return []  # transformers' caches: each architecture rotates differently; prefix reuse only
        cached = self._tokens[: self.cached]
        end = len(prompt) - 1  # the last prompt token is always fed

        def run(source: int, target: int) -> int:
            count = 0
            while (source + count < len(cached) and target + count < end
                   and cached[source + count] == prompt[target + count]):
                count += 1
            return count

        moves, source, target = [], common, common
        while source < len(cached) and target < end:
            for gap in range(min(self.MAX_GAP, source - target, end - 1 - target) + 1):
                count = run(source, target + gap)
                if count >= self.reuse_min:
                    moves.append((source, target + gap, count))
                    source, target = source + count, target + gap + count
                    break
            else:
                source += 1
        return moves

    INDEX = 8  # tokens a borrowed chunk is looked up by
    GAP_FORWARD = 256  # prompt tokens per forward between borrowed chunks (computed inside prepare)

    def borrowing(self, prompt: list[int], common: int, reused: int) -> list[tuple]:
        """Chunks of at least reuse_min tokens that the prompt holds and this session's cache (at any position, also
        later ones) or a donor's cache has: what llama.vim's :LlamaInstruct needs, whose prompt holds the lines its
        FIM requests cached, in a chat message further on and often in another slot. Returns (cache, source,
        target, count) copies in prompt order, the first the common prefix, when they cover at least reuse_min
        more of the prompt than `reused` (what the same session's prefix and moves would reuse); else []."""
        end = len(prompt) - 1  # the last prompt token is always fed
        if end - reused < self.reuse_min or not hasattr(self.path, "move"):
            return []
        donors = [(self.cache, self._tokens[: self.cached].tolist())]
        donors += [(other.cache, other._tokens[: other.cached].tolist()) for other in self.donors()
                   if other is not self and other.path is self.path]
        index = {}
        for number, (_, tokens) in enumerate(donors):
            for position in range(len(tokens) - self.INDEX + 1):
                index.setdefault(tuple(tokens[position : position + self.INDEX]), (number, position))
        plan = [(self.cache, 0, 0, min(common, self.cached))] if min(common, self.cached) > 0 else []
        target = plan[0][3] if plan else 0
        while target + self.INDEX <= end:
            found = index.get(tuple(prompt[target : target + self.INDEX]))
            count = 0
            if found is not None:
                number, source = found
                tokens = donors[number][1]
                while (source + count < len(tokens) and target + count < end
                       and tokens[source + count] == prompt[target + count]):
                    count += 1
            if count >= self.reuse_min:
                plan.append((donors[number][0], source, target, count))
                target += count
            else:
                target += 1
        return plan if sum(count for *_, count in plan) >= reused + self.reuse_min else []

    def borrow(self, prompt: list[int], common: int, plan: list[tuple]) -> int:
        """Build a fresh cache for `prompt` from the copies in `plan` (`borrowing`), computing the tokens between
        them; this session's old cache goes. The same approximation as the moves in reuse_chunks."""
        if common < self.length:
            self.truncate(common)  # the history was rewritten: tell the drafters
        cache, position, computed = self.path.new_cache(), 0, 0
        cache.reserve(len(prompt))
        for donor, source, target, count in plan:
            while position < target:  # the tokens between two chunks, in forwards of at most GAP_FORWARD
                cache.length = position
                step = min(target, position + self.GAP_FORWARD)
                self.path.batch([Rows(cache, prompt[position:step], 1, prompt=True)])  # as prefill_rows
                computed, position = computed + step - position, step
            self.path.move(donor, source, target, count, into=cache)
            position = target + count
        cache.length = position
        self.cache = cache
        self.append(prompt[common:])
        self.crop_cache(min(self.cached, len(prompt) - 1))
        return self.cached - computed

    def fork(self, source: "Session", prompt: list[int]) -> int:
        """Start this fresh session with the keys and values source holds of the prompt's common prefix, copied as
        they are (the same positions, the same bits): alternatives of one prompt compute it once. Returns the
        tokens copied (0 where the caches are not position-addressed tensors)."""
        count = min(common_prefix(source.history, prompt), source.cached, len(prompt) - 1)
        if self.length or count <= 0 or not hasattr(source.cache, "keys") or not hasattr(self.cache, "reserve"):
            return 0
        self.cache.reserve(max(count, getattr(source.cache, "capacity", count)))  # room to go on as the source did
        self.cache.keys[:, :, :count] = source.cache.keys[:, :, :count]
        self.cache.values[:, :, :count] = source.cache.values[:, :, :count]
        self.cache.length = count
        if hasattr(self.cache, "follow"):
            self.cache.follow(source.cache, count)
        self.append(source.history[:count].tolist())
        return count

    def append(self, tokens: list[int]) -> None:
        needed = self.length + len(tokens)
        if needed > len(self._tokens):
            grown = np.zeros(max(needed, 2 * len(self._tokens)), dtype=np.int64)
            grown[: self.length] = self._tokens[: self.length]
            self._tokens = grown
        self._tokens[self.length : needed] = tokens
        self.length = needed

    def truncate(self, new_len: int) -> None:
        """Cut the history back to new_len tokens; the cache follows and every drafter is told."""
        if new_len >= self.length:
            return
        self.length = new_len
        self.crop_cache(min(self.cached, new_len))  # prepare() leaves the last token pending again
        self.chain.truncate(new_len)

    def crop_cache(self, new_len: int) -> None:
        self.cache.crop(new_len)

    def use_chain(self, chain: Chain) -> None:
        """Swap the drafters (a request asked for another spec). The old ones are told the history is
        gone, so shared structures forget what this session taught them; the new ones start from here."""
        self.chain.truncate(0)
        self.chain = chain

    def reset(self) -> None:
        self.truncate(0)
        self.cache = self.path.new_cache()
