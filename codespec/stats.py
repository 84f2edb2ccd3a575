"""Statistics: per drafter (llama.cpp's fields) and per generation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace


@dataclass
class DrafterStats:
    """What one drafter did, in the fields llama.cpp reports for its speculative implementations."""

    name: str
    calls: int = 0  # times the drafter was asked for a draft
    gen_drafts: int = 0  # non-empty drafts it returned that the target verified
    skipped_drafts: int = 0  # drafts held back: adaptive speculation judged they would not pay
    acc_drafts: int = 0  # drafts with at least one accepted token
    gen_tokens: int = 0  # tokens it drafted
    acc_tokens: int = 0  # of those, tokens the target accepted
    begin_s: float = 0.0  # seconds spent in begin()
    draft_s: float = 0.0  # seconds spent in draft()
    accept_s: float = 0.0  # seconds spent in accept() and truncate()

    def copy(self) -> "DrafterStats":
        return DrafterStats(**asdict(self))

    def since(self, earlier: "DrafterStats") -> "DrafterStats":
        """The activity between `earlier` (a copy of this object) and now."""
        diff = {f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self) if f.name != "name"}
        return DrafterStats(name=self.name, **diff)

    @property
    def acceptance_rate(self) -> float:
        return self.acc_tokens / self.gen_tokens if self.gen_tokens else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["acceptance_rate"] = round(self.acceptance_rate, 4)
        for key in ("begin_s", "draft_s", "accept_s"):
            data[key] = round(data[key], 6)
        return data

    def summary(self) -> str:
        """One line in llama.cpp's shape: #calls, #gen drafts, #acc drafts, #gen tokens, #acc tokens, dur."""
        return (
            f"{self.name}: #calls = {self.calls}, #gen drafts = {self.gen_drafts}, #acc drafts = {self.acc_drafts}, "
            f"#skipped drafts = {self.skipped_drafts}, #gen tokens = {self.gen_tokens}, #acc tokens = {self.acc_tokens}, "
            f"dur(b,g,a) = {self.begin_s * 1e3:.3f}, {self.draft_s * 1e3:.3f}, {self.accept_s * 1e3:.3f} ms"
        )


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # tokens in the prompt
    cached_tokens: int = 0  # prompt tokens whose KV cache was reused from the session
    generated_tokens: int = 0  # new tokens emitted
    target_forwards: int = 0  # forwards of the target model, the prefill included
    drafted_tokens: int = 0  # draft tokens sent to verification
    accepted_tokens: int = 0  # draft tokens the target agreed with
    prefill_seconds: float = 0.0  # time to the first token
    forward_seconds: float = 0.0  # time in target forwards (and the accept decision waiting on them)
    seconds: float = 0.0  # wall time of the whole generation
    drafters: list[DrafterStats] = field(default_factory=list)

    def copy(self) -> "GenerationStats":
        """A snapshot: the engine goes on writing the original on its worker thread."""
        return replace(self, drafters=[d.copy() for d in self.drafters])

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def overhead_share(self) -> float:
        """The share of the time spent outside target forwards: drafting, bookkeeping, cache handling."""
        return max(0.0, 1.0 - self.forward_seconds / self.seconds) if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "target_forwards": self.target_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "forward_seconds": round(self.forward_seconds, 4),
            "overhead_share": round(self.overhead_share, 4),
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "drafters": [d.to_dict() for d in self.drafters],
        }

    def summary(self) -> str:
        return (
            f"{self.generated_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_second:.1f} tok/s), "
            f"{self.target_forwards} forwards ({self.tokens_per_forward:.2f} tok/forward), "
            f"acceptance {self.accepted_tokens}/{self.drafted_tokens} ({self.acceptance_rate:.0%}), "
            f"prompt {self.prompt_tokens} ({self.cached_tokens} cached), "
            f"{self.overhead_share:.1%} of the time outside forwards"
        )
