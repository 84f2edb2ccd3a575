"""How uvicorn serves the app. uvicorn waits forever for request headers that never end (a client that connects and
sends nothing, or half a request line: one such connection per open socket is enough to starve the server), so
connections use uvicorn's h11 protocol with a deadline for each request's headers. The body's deadline is the
ReadTimeout middleware's (it answers 408 in the app's error shape)."""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import ServerConfig


def uvicorn_options(config: ServerConfig) -> dict:
    """Keyword arguments for uvicorn.run / uvicorn.Config."""
    return {"http": header_deadline_protocol(config.read_timeout)}


def header_deadline_protocol(seconds: float) -> type[H11Protocol]:
    class HeaderDeadline(H11Protocol):
        """Closes a connection whose request headers are not complete `seconds` after it opened, or after the
        first bytes of its next request (between requests, uvicorn's keep-alive timeout closes an idle one)."""

        deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self.arm()

        def data_received(self, data: bytes) -> None:
            if self.deadline is None and self.conn.their_state is h11.IDLE:
                self.arm()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in
                self.disarm()

        def connection_lost(self, exc):
            self.disarm()
            super().connection_lost(exc)

        def arm(self) -> None:
            self.deadline = self.loop.call_later(seconds, self.expire)

        def disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def expire(self) -> None:
            self.deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
