"""The interface every drafter implements.

A drafter proposes tokens that the target model will probably produce next. It only ever changes
speed: the decode loop verifies every draft token against the target.

Lifecycle, per session:
  begin(history, params)          a generation starts; history ends with the new prompt; params are the
                                  SamplingParams (a draft model samples its drafts at the same temperature)
  draft(history, max_tokens)      propose up to max_tokens tokens to follow history (or None)
  accept(history, drafted, accepted)
                                  tokens were appended to history; drafted/accepted describe this
                                  drafter's own last draft (0, 0 when the draft came from another one)
  truncate(new_len)               history was cut back to new_len tokens (an edit above the cursor, a
                                  regeneration, a stripped block): forget what only the removed tokens taught
  set_reference(tokens)           before begin: the tokens of the text this generation rewrites, or None
                                  (only edit-align uses it)

`history` is a read-only numpy int64 array of the session's tokens, valid only during the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..config import SamplingParams


@dataclass
class Draft:
    tokens: list[int]
    # The distributions the tokens were sampled from ([k, vocab]); None for deterministic drafters.
    # With them the sampler uses rejection sampling with a residual distribution instead of exact match.
    probs: torch.Tensor | None = None
    # Seconds of the draft spent catching up on history the drafter had not read (a draft model after a
    # prompt or a pause): paid once, not per draft token, so adaptive speculation does not count it as one.
    catch_up_seconds: float = 0.0
    # A guess the drafter is not sure of (edit-align just after re-finding its place): the chain asks the drafters
    # after it first, and verifies this one only when none of them drafts.
    tentative: bool = False


def common_prefix(a, b) -> int:
    """How many leading tokens two token sequences share: what a cache or a drafter keeps of a history
    that was rewritten."""
    shared = min(len(a), len(b))
    mismatch = np.flatnonzero(np.asarray(a[:shared], dtype=np.int64) != np.asarray(b[:shared], dtype=np.int64))
    return int(mismatch[0]) if mismatch.size else shared


class Drafter:
    name: ClassVar[str] = "drafter"
    follows_reference: ClassVar[bool] = False  # drafts from a generation's reference (Chain.set_reference's reach)

    def begin(self, history: np.ndarray, params: SamplingParams) -> None:
        pass

    def draft(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        raise NotImplementedError

    def accept(self, history: np.ndarray, drafted: int, accepted: int) -> None:
        pass

    def truncate(self, new_len: int) -> None:
        pass

    def set_reference(self, tokens: list[int] | None) -> None:
        pass
