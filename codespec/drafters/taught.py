"""Documents taught to the shared ngram-mod pool (Engine.teach), so drafts can come from any open file.

Each document gets its own view of the pool (an NgramMod drafter that is never asked to draft). When the document
changes, the view is truncated at the first changed token, which takes back exactly what the old text after it
taught, and then learns the new text from there; when the document is forgotten, the view is truncated to nothing.
"""

from __future__ import annotations

import numpy as np

from .base import common_prefix
from .ngram_mod import NgramMod, NgramPool


class TaughtDocuments:
    def __init__(self):
        self.views: dict[str, tuple[NgramMod, np.ndarray, object]] = {}  # id -> (view, tokens taught, version)

    def current(self, document_id: str, version, pool: NgramPool) -> bool:
        """Whether the pool already holds this version of the document (None: a version is never current)."""
        view, _, taught_version = self.views.get(document_id, (None, None, None))
        return view is not None and version is not None and taught_version == version and view.pool is pool

    def teach(self, document_id: str, tokens: list[int], version, pool: NgramPool) -> None:
        tokens = np.asarray(tokens, dtype=np.int64)
        view, taught, _ = self.views.get(document_id, (None, None, None))
        if view is None or view.pool is not pool:
            if view is not None:
                view.truncate(0)
            view, taught = NgramMod(pool), tokens[:0]
        view.truncate(common_prefix(taught, tokens))
        view.begin(tokens, None)  # learns the tokens after what it already holds
        self.views[document_id] = (view, tokens, version)

    def forget(self, document_id: str) -> None:
        view = self.views.pop(document_id, None)
        if view is not None:
            view[0].truncate(0)
