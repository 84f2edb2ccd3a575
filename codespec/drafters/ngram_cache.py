"""`ngram-cache`: draft token by token from counts of what followed short n-grams (n = 1..n_max).

As in llama.cpp's lookup decoding, three count tables answer "which token follows these n tokens":
  context  every position of this session's history (prompt and output);
  dynamic  only positions the model generated (tokens that came through accept), kept across the
           generations of the session: it learns how this model continues, not how prompts read;
  static   an optional corpus-wide table loaded from a file, read-only and shared between sessions.
Both session tables forget on truncate: the drafter keeps its own copy of the tokens it indexed, so
it can recompute and uncount every n-gram that ended at a removed position.

A draft grows one token at a time, feeding its own tokens back as context. Each step asks the context
table (lax thresholds), then the dynamic table (strict), then the static one (strict), each from the
longest n-gram down, and takes the first answer whose top token clears the thresholds for that n:
enough samples (total count) and a large enough share (top count / total). The thresholds are
llama.cpp's; short n-grams need more evidence because they predict less. No answer ends the draft.
Tables are tried in order rather than merged: the session's own text predicts it best, and a corpus
count would drown it.

Static file format (`save_static_cache` / `load_static_cache`): a numpy .npz archive (no pickles)
with one row per (n-gram, next token) pair:
  format  "codespec-ngram-cache-v1"
  max_n   longest n-gram, an int
  ngrams  int64 [rows, max_n], each n-gram right-aligned and padded on the left with -1
  tokens  int64 [rows], the token that followed
  counts  int64 [rows], how often it followed (> 0)
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from ..config import SamplingParams
from .base import Draft, Drafter

FORMAT = "codespec-ngram-cache-v1"
PAD = -1
# per n-gram length n (index n - 1; longer n-grams use the last entry): fewest samples and smallest
# share in percent of the top token. Lax for the context table, strict for the dynamic and static ones.
LAX_MIN_SAMPLES, LAX_MIN_PERCENT = (2, 2, 1, 1), (66, 50, 50, 50)
STRICT_MIN_SAMPLES, STRICT_MIN_PERCENT = (4, 3, 2, 2), (75, 66, 66, 66)


class NextTokenCounts:
    """How often each token followed one n-gram; the total and the top token are kept up to date."""

    __slots__ = ("counts", "total", "top_token")

    def __init__(self):
        self.counts: dict[int, int] = {}
        self.total = 0
        self.top_token: int | None = None  # None = unknown, recomputed on the next top()

    def add(self, token: int, count: int = 1) -> None:
        new = self.counts.get(token, 0) + count
        self.counts[token] = new
        self.total += count
        top = self.top_token
        if top is not None and (new, -token) > (self.counts[top], -top):
            self.top_token = token

    def remove(self, token: int) -> None:
        left = self.counts[token] - 1
        if left:
            self.counts[token] = left
        else:
            del self.counts[token]
        self.total -= 1
        if token == self.top_token:
            self.top_token = None  # another token may lead now

    def top(self) -> tuple[int, int, int]:
        """(top token, its count, total); ties go to the smaller token id, so the answer is deterministic."""
        if self.top_token is None:
            self.top_token = max(self.counts.items(), key=lambda item: (item[1], -item[0]))[0]
        return self.top_token, self.counts[self.top_token], self.total


class CountTable:
    def __init__(self):
        self.ngrams: dict[tuple[int, ...], NextTokenCounts] = {}

    def add(self, ngram: tuple[int, ...], token: int) -> None:
        counts = self.ngrams.get(ngram)
        if counts is None:
            counts = self.ngrams[ngram] = NextTokenCounts()
        counts.add(token)

    def remove(self, ngram: tuple[int, ...], token: int) -> None:
        counts = self.ngrams[ngram]
        counts.remove(token)
        if not counts.total:
            del self.ngrams[ngram]

    def top(self, ngram: tuple[int, ...]) -> tuple[int, int, int] | None:
        counts = self.ngrams.get(ngram)
        return counts.top() if counts is not None else None


class StaticCache:
    """Read-only corpus statistics: n-gram -> {next token: count}, with every top token precomputed,
    so one instance can serve all sessions."""

    def __init__(self, counts: dict[tuple[int, ...], dict[int, int]], max_n: int):
        self.counts, self.max_n = counts, max_n
        self.tops = {ngram: top_of(following) for ngram, following in counts.items()}

    def top(self, ngram: tuple[int, ...]) -> tuple[int, int, int] | None:
        return self.tops.get(ngram)

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticCache) and (self.max_n, self.counts) == (other.max_n, other.counts)


def top_of(following: dict[int, int]) -> tuple[int, int, int]:
    token, count = max(following.items(), key=lambda item: (item[1], -item[0]))
    return token, count, sum(following.values())


def build_static_cache(token_sequences: Iterable[list[int]], max_n: int = 4) -> StaticCache:
    """Count, over every sequence, which token followed each n-gram of length 1..max_n."""
    if max_n < 1:
        raise ValueError(f"max_n must be at least 1, got {max_n}")
    counts: dict[tuple[int, ...], dict[int, int]] = {}
    for sequence in token_sequences:
        tokens = [int(token) for token in sequence]
        for position in range(1, len(tokens)):
            token = tokens[position]
            for n in range(1, min(max_n, position) + 1):
                following = counts.setdefault(tuple(tokens[position - n : position]), {})
                following[token] = following.get(token, 0) + 1
    return StaticCache(counts, max_n)


def save_static_cache(cache: StaticCache, path: str | Path) -> None:
    rows = [(ngram, token, count) for ngram, following in cache.counts.items() for token, count in following.items()]
    ngrams = np.full((len(rows), cache.max_n), PAD, dtype=np.int64)
    for row, (ngram, _, _) in enumerate(rows):
        ngrams[row, cache.max_n - len(ngram) :] = ngram
    tokens = np.array([token for _, token, _ in rows], dtype=np.int64)
    counts = np.array([count for _, _, count in rows], dtype=np.int64)
    with open(path, "wb") as file:  # a file object: np.savez would append ".npz" to a bare path
        np.savez_compressed(file, format=np.array(FORMAT), max_n=np.array(cache.max_n), ngrams=ngrams,
                            tokens=tokens, counts=counts)


def load_static_cache(path: str | Path) -> StaticCache:
    """Load a file written by save_static_cache; ValueError with a one-line reason if it is not one."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in ("format", "max_n", "ngrams", "tokens", "counts")}
    except FileNotFoundError:
        raise  # a missing file is not a corrupt one
    except (OSError, ValueError, EOFError, KeyError, AttributeError, TypeError, zipfile.BadZipFile) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: not a codespec n-gram cache file ({reason})") from None
    problem = check_arrays(arrays)
    if problem:
        raise ValueError(f"{path}: not a codespec n-gram cache file ({problem})")
    max_n = int(arrays["max_n"])
    counts: dict[tuple[int, ...], dict[int, int]] = {}
    for ngram, token, count in zip(arrays["ngrams"].tolist(), arrays["tokens"].tolist(), arrays["counts"].tolist()):
        counts.setdefault(tuple(t for t in ngram if t != PAD), {})[token] = count
    return StaticCache(counts, max_n)


def check_arrays(arrays: dict[str, np.ndarray]) -> str | None:
    """What is wrong with the loaded arrays, or None."""
    max_n, ngrams, tokens, counts = (arrays[name] for name in ("max_n", "ngrams", "tokens", "counts"))
    if arrays["format"].shape != () or str(arrays["format"]) != FORMAT:
        return f"format is not {FORMAT}"
    if max_n.shape != () or max_n.dtype.kind != "i" or int(max_n) < 1:
        return "max_n is not a positive integer"
    rows = len(tokens)
    if ngrams.shape != (rows, int(max_n)) or tokens.shape != (rows,) or counts.shape != (rows,):
        return "array shapes disagree"
    if any(array.dtype.kind != "i" for array in (ngrams, tokens, counts)):
        return "arrays are not integers"
    present = ngrams != PAD
    # padding only on the left, at least one token per n-gram, no negative token ids
    if rows and (not present[:, -1].all() or (present[:, 1:] < present[:, :-1]).any() or (ngrams < PAD).any()):
        return "malformed n-grams"
    if (tokens < 0).any() or (counts <= 0).any():
        return "negative tokens or non-positive counts"
    return None


class NgramCache(Drafter):
    name = "ngram-cache"

    def __init__(self, static: StaticCache | None = None, n_max: int = 4):
        if n_max < 1:
            raise ValueError(f"ngram-cache needs n_max >= 1, got {n_max}")
        self.static, self.n_max = static, n_max
        self.context, self.dynamic = CountTable(), CountTable()
        # asked in this order, each with its thresholds: the session's own text predicts it best
        self.tables = [(self.context, LAX_MIN_SAMPLES, LAX_MIN_PERCENT),
                       (self.dynamic, STRICT_MIN_SAMPLES, STRICT_MIN_PERCENT)]
        if static is not None:
            self.tables.append((static, STRICT_MIN_SAMPLES, STRICT_MIN_PERCENT))
        self.tokens: list[int] = []  # the indexed history, so truncate can find what to uncount
        self.generated: list[bool] = []  # per position: did it come through accept (also in dynamic)

    def begin(self, history: np.ndarray, params: SamplingParams) -> None:
        self.sync(history, generated=False)  # what the prompt added

    def accept(self, history: np.ndarray, drafted: int, accepted: int) -> None:
        self.sync(history, generated=True)

    def truncate(self, new_len: int) -> None:
        for position in range(len(self.tokens) - 1, max(new_len, 1) - 1, -1):
            self.count(position, CountTable.remove)
        del self.tokens[new_len:], self.generated[new_len:]

    def draft(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        self.sync(history, generated=False)
        tail = self.tokens[-self.n_max :]  # grows with the draft: each drafted token is context for the next
        drafted: list[int] = []
        while len(drafted) < max_tokens:
            token = self.next_token(tail)
            if token is None:
                break
            drafted.append(token)
            tail.append(token)
        return Draft(drafted) if drafted else None

    def next_token(self, tail: list[int]) -> int | None:
        ngrams = [tuple(tail[-n:]) for n in range(min(self.n_max, len(tail)), 0, -1)]  # longest first
        for table, min_samples, min_percent in self.tables:
            for ngram in ngrams:
                top = table.top(ngram)
                if top is None:
                    continue
                token, count, total = top
                level = min(len(ngram), len(min_samples)) - 1
                if total >= min_samples[level] and 100 * count >= min_percent[level] * total:
                    return token
        return None

    def sync(self, history: np.ndarray, generated: bool) -> None:
        """Count the positions the history gained since the last call (or forget, if it shrank)."""
        indexed = len(self.tokens)
        if len(history) < indexed:
            self.truncate(len(history))
        elif len(history) > indexed:
            self.tokens.extend(history[indexed:].tolist())
            self.generated.extend([generated] * (len(history) - indexed))
            for position in range(max(indexed, 1), len(self.tokens)):
                self.count(position, CountTable.add)

    def count(self, position: int, update: Callable[[CountTable, tuple[int, ...], int], None]) -> None:
        """Apply `update` (add or remove) for every n-gram that ends just before `position`."""
        token, tables = self.tokens[position], [self.context]
        if self.generated[position]:
            tables.append(self.dynamic)
        for n in range(1, min(self.n_max, position) + 1):
            ngram = tuple(self.tokens[position - n : position])
            for table in tables:
                update(table, ngram, token)
