"""The one exception type that reaches users as a one-line message."""


class CodespecError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""
