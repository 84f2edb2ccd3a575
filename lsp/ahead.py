"""Accept-ahead: while a suggestion is on screen, compute the one that follows accepting it.

The user accepts most suggestions, and after an accept the editor asks again at once, at the end of the inserted
text. So as soon as a suggestion is answered, the document as it would read after accepting it (the suggestion
inserted at the cursor, the cursor after it) is completed in the background, in the document's own session. When
the next request comes for exactly that text and cursor, it is answered from that work: at once if it is done,
else as soon as it is (the same generation the request would have started, already under way). Any other request
for the document cancels it. The accepted text is also the best draft there is: the background prompt extends the
session's cache by exactly that text.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .documents import Document


@dataclass
class Ahead:
    text: str  # the document after the accept
    offset: int  # the cursor after the accept
    task: asyncio.Task  # -> (suggestion, stats, context) or None


class AcceptAhead:
    def __init__(self, suggest):
        """suggest(document, offset, wanted): the Completer's generation of a suggestion (Completer.suggest)."""
        self.suggest = suggest
        self.pending: dict[str, Ahead] = {}  # uri -> the follow-up being computed or done

    def start(self, document: Document, offset: int, completion) -> None:
        """`completion` is now shown at `offset` of `document`: compute what follows accepting it."""
        self.drop(document.uri)
        text = document.text[:offset] + completion.text + document.text[offset:]
        accepted = Document(document.uri, text, document.version, document.language_id)
        cursor = offset + len(completion.text)
        task = asyncio.create_task(self.suggest(accepted, cursor, lambda: True))
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # never "exception not retrieved"
        self.pending[document.uri] = Ahead(text, cursor, task)

    async def take(self, document: Document, offset: int):
        """The follow-up for this text and cursor, waiting for it if it is still being computed; None when there is
        none (any other state cancels the one there was)."""
        ahead = self.pending.get(document.uri)
        if ahead is None:
            return None
        if ahead.text != document.text or ahead.offset != offset:
            self.drop(document.uri)
            return None
        del self.pending[document.uri]
        try:
            result = await ahead.task
        except asyncio.CancelledError:
            if ahead.task.cancelled():  # only it was cancelled, not this request
                return None
            ahead.task.cancel()
            raise
        except Exception:  # a failed follow-up: the request computes its own
            return None
        return result  # an empty suggestion too: asking again would only find the same

    def drop(self, uri: str) -> None:
        ahead = self.pending.pop(uri, None)
        if ahead is not None:
            ahead.task.cancel()
