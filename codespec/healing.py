"""Token healing: a prompt that ends mid-token is backed up over its last token, and generation must spell that
token's text again before anything else (token healing, as Guidance does it).

Editors cut prompts at the cursor, not at token boundaries. On an empty line the prompt ends with a bare newline,
where this kind of tokenizer writes newline-plus-indentation as one token, so the model, having never seen a bare
newline before code, writes another one: the suggestion starts with blank lines. Half an identifier has the same
problem in principle, but healing a word lets the model second-guess what was typed (heal), so only whitespace is
healed. Backing up one token and constraining the first generated tokens to start with its text lets the model
choose the token it would have used ("\\n        ") and the suggestion starts where a person expects.

Constraints work on token strings (the vocabulary's own spelling: "Ċ" for a byte-level newline), so every token is
a string and "starts with" is exact whatever the bytes. Lossless with respect to the healed prompt: the constraint
masks the target's logits at the constrained positions before a token is chosen or a draft token is compared, in
plain and speculative decoding alike.
"""

from __future__ import annotations

import bisect


class Vocabulary:
    """The tokenizer's token strings, sorted, for "which tokens start with this text" in a bisection."""

    def __init__(self, tokenizer):
        size = len(tokenizer)
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
        self.pieces = [None if i in special or not p else p for i, p in enumerate(pieces)]
        self.ids = {p: i for i, p in enumerate(self.pieces) if p}
        self.sorted = sorted(self.ids)
        self.size = size
        self.tokenizer = tokenizer

    def starting_with(self, text: str) -> list[int]:
        start = bisect.bisect_left(self.sorted, text)
        end = bisect.bisect_left(self.sorted, text + "\U0010ffff")
        return [self.ids[p] for p in self.sorted[start:end]]

    def allowed(self, remaining: str) -> list[int]:
        """Tokens that may come next when `remaining` is still to be spelt: those that start with all of it, and
        those that are a first part of it."""
        parts = [self.ids[remaining[:k]] for k in range(1, len(remaining)) if remaining[:k] in self.ids]
        return self.starting_with(remaining) + parts

    def text(self, piece: str) -> str:
        return self.tokenizer.convert_tokens_to_string([piece])


def heal(vocabulary: Vocabulary, ids: list[int], keep: int) -> tuple[list[int], str | None]:
    """The prompt without its last token when that token is whitespace (a bare newline, indentation, a space) that a
    longer token starts with, and that token's string (None: nothing to heal). The first `keep` tokens stay.

    Only whitespace: a word the user typed is kept as typed. Healing it lets the model reconsider the word with the
    priors it had before it (measured in a real VS Code: after `return math` it chose " mathematical" over " math"
    and suggested `ematical_math.pi * ...` where the unhealed prompt gave `.pi * radius ** 2`)."""
    if len(ids) <= max(keep, 1):
        return ids, None
    piece = vocabulary.pieces[ids[-1]] if ids[-1] < vocabulary.size else None
    if piece is None or vocabulary.text(piece).strip() or len(vocabulary.starting_with(piece)) < 2:
        return ids, None
    return ids[:-1], piece


class Constraint:
    """What the generated tokens must spell first (a healed piece), step by step."""

    def __init__(self, vocabulary: Vocabulary, piece: str):
        self.vocabulary = vocabulary
        self.remaining = piece  # "" once spelt

    def after(self, remaining: str, token: int) -> str | None:
        """What is left to spell after `token`; None when the token is not allowed there."""
        piece = self.vocabulary.pieces[token] if token < self.vocabulary.size else None
        if piece is None:
            return None
        if piece.startswith(remaining):
            return ""
        return remaining[len(piece):] if remaining.startswith(piece) else None

    def mask(self, logits, draft: list[int]) -> None:
        """Limit each row of logits [k+1, vocab] that is still constrained, given that the rows before it
        accepted the draft tokens before it."""
        import torch  # here: the language server imports this module (via context.fim) before it needs torch

        remaining = self.remaining
        for row in range(logits.shape[0]):
            if not remaining:
                return
            allowed = torch.tensor(self.vocabulary.allowed(remaining), dtype=torch.long, device=logits.device)
            masked = torch.full_like(logits[row], float("-inf"))
            masked[allowed] = logits[row, allowed]
            logits[row] = masked
            if row >= len(draft):
                return
            remaining = self.after(remaining, draft[row])
            if remaining is None:  # this draft token is not allowed: verification stops here anyway
                return

    def advance(self, tokens: list[int]) -> None:
        for token in tokens:
            if not self.remaining:
                return
            self.remaining = self.after(self.remaining, token) or ""
