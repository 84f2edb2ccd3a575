"""codespec: a coding-assistant backend built on lossless self-speculative decoding."""

__version__ = "0.1.0"
