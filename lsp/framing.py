"""The base protocol's framing on stdin (`Content-Length: N`, a blank line, N bytes of JSON), checked as pygls
reads it.

pygls skips a header line it cannot read (`Content-Length: abc`, or the rest of a body that was longer than its
Content-Length said) and then takes every following message for more headers: the server stays alive and never
answers again. Where the framing breaks, the next message starts at a place nobody knows, so the stream ends
there instead: the server stops with the reason on stderr and status 1, and the editor restarts it.
"""

from __future__ import annotations

import re

HEADER = re.compile(rb"([A-Za-z][A-Za-z0-9-]*):([^\r\n]*)\r\n")
MAX_MESSAGE_BYTES = 1 << 30  # a longer body is a corrupt header, not a message


class FramingError(ValueError):
    pass


class CheckedInput:
    """A binary stdin for pygls' reader (readline for header lines, read for bodies) that checks each header.
    At the first broken one it reads as the end of the stream, and `error` says why."""

    def __init__(self, stream):
        self.stream = stream
        self.content_length: int | None = None  # of the message whose headers are being read
        self.error: str | None = None

    def readline(self) -> bytes:
        line = self.stream.readline()
        if not line or self.error is not None:
            return b""
        try:
            return self.check(line)
        except FramingError as exc:
            self.error = str(exc)
            return b""

    def read(self, size: int) -> bytes:
        return self.stream.read(size)

    def check(self, line: bytes) -> bytes:
        """The header line as pygls should read it, or a FramingError."""
        if line == b"\r\n":  # the end of the headers
            if self.content_length is None:
                raise FramingError("a message without a Content-Length header")
            self.content_length = None
            return line
        match = HEADER.fullmatch(line)
        if match is None:
            raise FramingError(f"not a header line: {line[:80]!r}")
        name, value = match[1], match[2].strip()
        if name.lower() != b"content-length":
            return line  # Content-Type: utf-8 is all there is
        if not value.isdigit() or int(value) > MAX_MESSAGE_BYTES:
            raise FramingError(f"Content-Length is not a length: {value[:40]!r}")
        self.content_length = int(value)
        return b"Content-Length: %d\r\n" % self.content_length  # the one spelling pygls recognises
