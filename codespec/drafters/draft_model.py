"""`draft`: a smaller causal LM with the target's vocabulary drafts the next tokens, one at a time.

Classic speculative decoding (Leviathan et al., 2023; Chen et al., 2023): a model a fraction of the
target's size often predicts what the target will say, and the target checks a whole draft in one forward.

The draft model keeps its own KV cache and the token ids that cache covers. Every draft() first syncs
that cache with the session history by longest common prefix, so draft tokens the target rejected, a
truncation and an edit above the cursor all show up as a divergence and are cropped, while tokens it has
not seen yet (the prompt, the target's own token, drafts that came from another drafter) are fed in one
forward. accept() and truncate() crop eagerly too, so between steps the cache never runs ahead of the
history.

Window: the draft model reads only the most recent WINDOW tokens, so filling its cache for a long editor
prompt (or catching up after adaptive speculation held it back) costs a forward over WINDOW tokens at most,
not over the whole prompt. Its cache starts at history[offset]; once it covers 2 x WINDOW tokens it starts
again from the last WINDOW. Positions restart at 0 there: rotary attention depends on distances only.
A sync that feeds more than the last couple of tokens reports its time as the draft's catch_up_seconds,
which adaptive speculation leaves out of the drafter's per-token cost.

Greedy (temperature 0): argmax drafts, probs=None, verified by exact match. Sampled: each token is drawn
from warp(logits, params), the temperature/top-k/top-p the target is verified with, and those
distributions travel with the draft, so the sampler uses rejection sampling with a residual: lossless
whatever the draft model is; a better draft model only gets more tokens accepted.

p_min: drafting stops before a token when the draft model's confidence, the top probability of
softmax(logits) at temperature 1, is below p_min. It is the same measure in greedy and sampled mode, so
p_min means the same thing whatever the sampling params. The first token can be dropped too, and an
empty draft is None. The decision is made before the token is drawn, from the draft model alone, so it
cannot bias which tokens are accepted.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from ..config import SamplingParams
from ..errors import CodespecError
from ..forward import forward_path
from ..sampling import draw, warp
from .base import Draft, Drafter, common_prefix

# The sampler seeds its generator with params.seed itself. The draft's stream must be a different one:
# drawing a draft token and its acceptance test from the same random numbers would correlate them.
DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15


class DraftModel(Drafter):
    name = "draft"
    WINDOW = 128  # tokens of history the draft model reads

    def __init__(self, model, p_min: float = 0.0, target_vocab_size: int | None = None, path=None,
                 window: int | None = WINDOW):
        """model: a transformers causal LM, loaded and on its device. target_vocab_size: the width of the
        target's logits when it differs from the draft model's (same tokenizer, differently padded
        embeddings, as across Qwen2.5 sizes); draft logits are then cut or padded with -inf to match.
        path: the model's forward (forward.py), shared by every session's drafter; built here when not given.
        window: tokens of history read (None: all of it)."""
        self.model = model
        self.p_min = p_min
        self.target_vocab_size = target_vocab_size
        self.context = getattr(model.config, "max_position_embeddings", None)
        self.path = path or forward_path(model)
        self.window = window
        self.cache = self.path.new_cache()
        self.offset = 0  # self.cache covers history[offset:offset + len(self.tokens)]
        self.tokens: list[int] = []  # the token ids self.cache covers, in order
        self.params = SamplingParams()
        self.generator = torch.Generator(device=model.device)

    @property
    def cached(self) -> int:
        return len(self.tokens)

    def begin(self, history: np.ndarray, params: SamplingParams) -> None:
        self.params = params
        if params.seed is not None:
            self.generator.manual_seed((params.seed + DRAFT_SEED_OFFSET) % 2**64)
        else:
            self.generator.seed()

    @torch.no_grad()
    def draft(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        if max_tokens < 1 or len(history) == 0:
            return None
        sampled = self.params.temperature > 0
        if not sampled and self.p_min == 0 and self._greedy_on_device():
            return self._draft_on_device(history, max_tokens)
        started = time.perf_counter()
        logits, fed = self._sync(history)  # [vocab] for the position after history
        catch_up = time.perf_counter() - started if fed > 2 else 0.0
        if self.context is not None:
            # drafting k tokens feeds k-1 of them after the cached ones: keep every position inside the context
            max_tokens = min(max_tokens, self.context + 1 - len(self.tokens))
        tokens: list[int] = []
        distributions: list[torch.Tensor] = []
        while len(tokens) < max_tokens:
            if self.p_min > 0 and float(logits.float().softmax(-1).max()) < self.p_min:
                break
            if sampled:
                distribution = warp(logits[None], self.params)[0]  # [vocab]
                token = draw(distribution, self.generator)
                distributions.append(distribution)
            else:
                token = int(logits.argmax())
            tokens.append(token)
            if len(tokens) < max_tokens:  # the last token needs no forward: nothing follows it
                logits = self._feed([token])
        if not tokens:
            return None
        return Draft(tokens, torch.stack(distributions) if sampled else None, catch_up_seconds=catch_up)

    def _greedy_on_device(self) -> bool:
        """Whether the forward can run a whole greedy draft on the device (graphs.py) for this vocabulary."""
        return hasattr(self.path, "greedy") and self.target_vocab_size in (None, self.model.config.vocab_size)

    def _draft_on_device(self, history: np.ndarray, max_tokens: int) -> Draft | None:
        """A greedy draft on the graph-safe forward: the same tokens as draft()'s loop, with the device waited for
        twice per draft instead of twice per token."""
        fresh = self._fresh(history)
        catch_up = 0.0
        if len(fresh) > 2:  # catching up on history: timed apart, as in draft()
            started = time.perf_counter()
            self._feed(fresh[:-1])
            catch_up, fresh = time.perf_counter() - started, fresh[-1:]
        if self.context is not None:
            max_tokens = min(max_tokens, self.context + 1 - len(self.tokens) - len(fresh))
        if max_tokens < 1:
            return None
        tokens = self.path.greedy(self.cache, fresh, max_tokens)
        self.tokens.extend(fresh + tokens[:-1])
        return Draft(tokens, None, catch_up_seconds=catch_up)

    @torch.no_grad()
    def accept(self, history: np.ndarray, drafted: int, accepted: int) -> None:
        self._crop(self.offset + common_prefix(self.tokens, history[self.offset:]))  # rejected drafts leave now

    @torch.no_grad()
    def truncate(self, new_len: int) -> None:
        self._crop(new_len)

    def _sync(self, history: np.ndarray) -> tuple[torch.Tensor, int]:
        """Make the cache cover the window of history; return the logits for the next position and how many
        tokens were fed."""
        fresh = self._fresh(history)
        return self._feed(fresh), len(fresh)

    def _fresh(self, history: np.ndarray) -> list[int]:
        """Crop the cache to what history still shares with it; return the tokens to feed after it."""
        if self.window is not None and (len(history) <= self.offset or len(history) - self.offset > 2 * self.window):
            self._crop(self.offset)  # empty: start again from the last WINDOW tokens
            self.offset = max(0, len(history) - self.window)
        # the last history token is always fed (again, if it was cached) because only a forward gives logits
        keep = min(common_prefix(self.tokens, history[self.offset:]), len(history) - 1 - self.offset)
        self._crop(self.offset + keep)
        return history[self.offset + keep:].tolist()

    def _crop(self, new_len: int) -> None:
        """Keep the cache for history[:new_len] (whatever of it lies in the window)."""
        new_len = max(new_len - self.offset, 0)
        excess = len(self.tokens) - new_len
        if excess > 0:
            self.cache.crop(new_len)
            del self.tokens[new_len:]

    def _feed(self, token_ids: list[int]) -> torch.Tensor:
        logits = self.path(self.cache, token_ids, 1)  # [1, vocab]
        self.tokens.extend(token_ids)
        return self._fit_vocab(logits[-1])

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        width, target = logits.shape[-1], self.target_vocab_size
        if target is None or width == target:
            return logits
        if width > target:
            return logits[:target]
        return torch.nn.functional.pad(logits, (0, target - width), value=float("-inf"))


def check_compatible(target_tokenizer, draft_tokenizer) -> None:
    """Drafts are token ids, so both models must map ids to the same strings."""
    target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target == draft:
        return
    differing = len(target.keys() ^ draft.keys()) + sum(target[t] != draft[t] for t in target.keys() & draft.keys())
    raise CodespecError(
        f"the draft model's vocabulary differs from the target's ({len(draft)} vs {len(target)} tokens, "
        f"{differing} not shared); a draft model must use the target's tokenizer"
    )


def truncated_copy(model, num_layers: int):
    """A cheap self-derived draft model: `model` with only its first num_layers decoder layers.

    The copy shares the weight storage with `model` (new Parameter objects over the same tensors, so
    .to() on the copy leaves `model` alone, but in-place edits reach both); only the modules are copied.
    The early layers plus the final norm and the head still make a (rough) next-token predictor.
    """
    layers = model.model.layers
    if not 1 <= num_layers <= len(layers):
        raise CodespecError(f"a truncated draft model needs 1..{len(layers)} layers, got {num_layers}")
    shared = {id(p): torch.nn.Parameter(p.data, requires_grad=p.requires_grad) for p in model.parameters()}
    draft = copy.deepcopy(model, shared)
    draft.model.layers = draft.model.layers[:num_layers]
    config = draft.config
    old_layers = config.num_hidden_layers
    config.num_hidden_layers = num_layers  # the forward and DynamicCache(config=...) both read it
    for key, value in list(vars(config).items()):
        # per-layer lists (layer_types, no_rope_layers, ...) must describe the layers that are left
        if "layer" in key and isinstance(value, (list, tuple)) and len(value) == old_layers:
            setattr(config, key, value[:num_layers])
    return draft
