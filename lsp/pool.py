"""Open documents teach the engine's shared ngram-mod pool, so drafts can come from any open file.

Each document gets its own view of the pool (an NgramMod drafter that is never asked to draft). When the
document changes, the view is truncated at the first changed token, which takes back exactly what the old text
after it taught, and then learns the new text from there; when the document is gone, the view is truncated to
nothing. Everything here runs on the engine's thread (Scheduler.call): the pool is not thread-safe.
"""

from __future__ import annotations

import numpy as np


class PoolFeed:
    def __init__(self):
        self.views: dict[str, tuple[NgramMod, np.ndarray, int]] = {}  # uri -> (view, tokens taught, version)

    def sync(self, engine, spec, documents) -> None:
        """documents: (uri, version, text) of the documents that should be in the pool now."""
        if "ngram-mod" not in spec.spec:
            return
        # imported here, as the engine is: codespec.drafters imports torch, and the server should answer
        # initialize without waiting for that
        from codespec.drafters import NgramMod
        from codespec.drafters.base import common_prefix

        pool = engine.shared.pool(spec)
        for uri, version, text in documents:
            view, taught, taught_version = self.views.get(uri, (None, None, None))
            if view is not None and taught_version == version and view.pool is pool:
                continue
            tokens = np.asarray(engine.tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)
            if view is None or view.pool is not pool:
                if view is not None:
                    view.truncate(0)
                view, taught = NgramMod(pool), tokens[:0]
            view.truncate(common_prefix(taught, tokens))
            view.begin(tokens, None)  # learns the tokens after what it already holds
            self.views[uri] = (view, tokens, version)

    def forget(self, engine, uri: str) -> None:
        view = self.views.pop(uri, None)
        if view is not None:
            view[0].truncate(0)
