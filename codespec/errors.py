"""The one exception type that reaches users as a one-line message."""


class CodespecError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""


class DeviceMemoryFull(CodespecError):
    """The device has no memory left for another session's cache, even after the idlest sessions went (a 503)."""
