"""`none`: never drafts, so every step is one plain forward. The baseline every drafter is measured against."""

from __future__ import annotations

import numpy as np

from .base import Draft, Drafter


class NoDrafter(Drafter):
    name = "none"

    def draft(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        return None
