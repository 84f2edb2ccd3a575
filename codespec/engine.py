"""The engine: one model, its tokenizer, and many sessions. Text in, text and statistics out.

Nothing above the engine touches tensors; nothing below it knows about HTTP or LSP.
"""

from __future__ import annotations

import concurrent.futures
import functools
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from .adaptive import Adaptive, CostModel, DraftingCosts, cached_costs, pinned_costs
from .config import MODEL_DRAFTERS, SESSION_MEMORY, ModelConfig, SamplingParams, SpecConfig
from .decode import decode_steps, drive, next_output, prefill_rows
from .drafters import warm as warm_drafters, SharedDrafting, build_chain
from .drafters.edit_align import EditAlign
from .drafters.taught import TaughtDocuments
from .errors import CodespecError, DeviceMemoryFull
from .forward import auto_gguf, build, resolve
from .healing import Constraint, Vocabulary, heal
from .sampling import Sampler
from .session import Session
from .stats import GenerationStats

PLAIN = ("none",)
KEEP, FORGET = "keep", "forget"  # what the shared pool does with a dropped session's teaching (Engine.drop)


@dataclass
class SessionInfo:
    """What frontends may know of a session (/slots, /metrics, picking a slot by shared prefix)."""

    id: str
    tokens: int  # history length
    cached: int  # of those, tokens in the KV cache
    cache_bytes: int  # KV cache and history
    spec: tuple[str, ...]  # its drafter chain
    drafters: list  # each drafter's statistics (copies)
    history: object  # read-only view of its tokens


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str  # "eos", "stop" (a stop string) or "length"
    stats: GenerationStats
    logprobs: list | None = None  # with SamplingParams.logprobs >= 0: each of `tokens`' decode.TokenLogprob

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


@dataclass
class Chunk:
    """A piece of streamed output: the text that became final and the tokens of this step."""

    text: str
    tokens: list[int]
    result: GenerationResult | None = None  # set on the last chunk
    stats: GenerationStats | None = None  # the generation's statistics so far (live: progress, a cut-short job)
    logprobs: list | None = None  # with SamplingParams.logprobs >= 0: each of `tokens`' decode.TokenLogprob


def namespace(session_id: str) -> str:
    """The API key's namespace a session name starts with (server/middleware.py: "k0|", ...), or ""."""
    return session_id[: session_id.index("|") + 1] if "|" in session_id else ""


@dataclass
class Engine:
    model: object
    tokenizer: object
    spec: SpecConfig = field(default_factory=SpecConfig)
    eos_token_ids: frozenset[int] = frozenset()
    sessions: dict[str, Session] = field(default_factory=dict)
    shared: SharedDrafting | None = None  # one ngram-mod pool (and draft model) for all sessions
    forward: str = "lean"  # see ModelConfig.forward
    session_memory: int = SESSION_MEMORY  # KV-cache bytes named sessions may hold; evict() drops the idlest
    cache_reuse: int = 0  # > 0: reuse cached chunks of at least this many tokens at new positions (Session.prepare)
    gguf: Path | None = None  # --weights gguf: the lean forward runs this file's own blocks (block_tiles.py)
    prompt_precision: str = ModelConfig.prompt_precision
    cache_type: str = ModelConfig.cache_type
    activations: str = ModelConfig.activations
    invariant: str = ModelConfig.invariant
    context: int = 0  # ModelConfig.context: tokens of context, 0 for the model's own

    def __post_init__(self):
        # the target forward, all sessions
        self.plan = resolve(self.model, "transformers" if self.forward == "transformers" else "lean", self.gguf,
                            self.prompt_precision, self.cache_type, self.activations, self.invariant == "on",
                            graphs=True if self.forward == "graphs" else None)
        self.path = build(self.plan, self.model, self.context_length)
        check_forward(self.path, self.model)
        if self.model.device.type == "cuda" and self.session_memory == SESSION_MEMORY:
            import torch

            free, _ = torch.cuda.mem_get_info(self.model.device)  # after the weights and the first cache
            self.session_memory = int(0.8 * free)  # named sessions' caches may take most of the GPU's free memory
        pinned = os.environ.get("CODESPEC_COSTS")  # read now: a bad table stops the start, not a request
        self._costs = pinned_costs(pinned) if pinned else None
        # what a step costs beyond the forward here, and how draft models did (not learnt with a pinned table)
        self.drafting = DraftingCosts(pinned=self._costs is not None)
        warm_drafters()  # their numba code loads now, not in the first request (~0.3 s)
        if self.shared is None:
            self.shared = SharedDrafting(self.model, self.tokenizer, self.spec)
        self.documents = TaughtDocuments()
        if not self.eos_token_ids:
            self.eos_token_ids = frozenset(eos_ids(self.model, self.tokenizer))

    @classmethod
    def load(cls, model_config: ModelConfig | None = None, spec: SpecConfig | None = None,
             show_progress: bool = True) -> "Engine":
        """The engine for a model, loaded on a thread of its own that ends with the load. PyTorch and numba share
        one OpenMP runtime, which spins its idle workers only while it manages no more threads than there are
        CPUs; each thread that runs parallel work keeps a team until it ends. Loaded on the main thread, the
        model's team outlived the load, and the server's engine thread, with a team of its own, went past that:
        measured on 2 cores, a numba region 1.4 -> 15-28 us, a one-token forward 3.8 -> 9 ms."""
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="codespec-load") as loader:
            return loader.submit(cls._load, model_config, spec, show_progress).result()

    @classmethod
    def _load(cls, model_config: ModelConfig | None, spec: SpecConfig | None, show_progress: bool) -> "Engine":
        from .forward.models import DEFAULT_ALIASES, gguf_source, load

        model_config = model_config or ModelConfig()
        gguf = gguf_source(model_config.model) if model_config.weights == "gguf" else None
        model, tokenizer = load(model_config, show_progress=show_progress)
        if model_config.weights == "auto":  # the GGUF the model came from, where its blocks run here
            from_gguf = model_config.model in DEFAULT_ALIASES or model_config.model.endswith(".gguf")
            gguf = auto_gguf(model, model_config.forward, gguf_source(model_config.model) if from_gguf else None)
        engine = cls(model, tokenizer, spec or SpecConfig(), forward=model_config.forward, gguf=gguf,
                   prompt_precision=model_config.prompt_precision, cache_type=model_config.cache_type,
                   activations=model_config.activations, context=model_config.context,
                   invariant=model_config.invariant)
        return engine

    @functools.cached_property
    def transformers_model(self):
        """The model for transformers' own forward (the bench's transformers rows): the model, or for one read directly
        from its GGUF (its weights placeholders) a float32 copy with the file's values (gguf_model.materialized)."""
        if getattr(self.model, "gguf_direct", None) is None:
            return self.model
        from .forward.gguf_model import materialized

        return materialized(self.model)

    @property
    def context_length(self) -> int:
        """Tokens of context: the model's own, or fewer (--ctx-size)."""
        own = int(getattr(self.model.config, "max_position_embeddings", 2048))
        return min(own, self.context) if self.context > 0 else own

    @property
    def costs(self) -> CostModel:
        """Seconds per target forward over n tokens on this device, measured on first use (adaptive.py)."""
        if self._costs is None:
            self._costs = cached_costs(self.path, self.model, self.model.config.vocab_size)
        return self._costs

    def session(self, session_id: str | None = None, spec: SpecConfig | None = None) -> Session:
        """The named session (created on first use); None gives a fresh, unnamed one."""
        spec = replace(spec or self.spec, **self.spec.pool_settings())  # one pool: the engine's
        if not self.path.rewindable and spec.spec != PLAIN:
            # the cache cannot take back a rejected draft (recurrent layers, see forward.TransformersCache):
            # each one would cost a whole prefill, so this model decodes plainly, which is never slower
            spec = replace(spec, spec=PLAIN)
        session = self.sessions.get(session_id) if session_id is not None else None
        if session is None:
            session = self._new_session(spec, session_id)
            if session_id is not None:
                self.sessions[session_id] = session
        elif session.spec.drafter_key() != spec.drafter_key():
            session.use_chain(build_chain(spec, self.shared))
        else:  # same drafters: what they hold stays, only the per-step limits change
            session.chain.draft_min = spec.draft_min
        session.reuse_min = self.cache_reuse
        session.donors = (lambda: self.donors(session_id)) if session_id is not None else None
        if session_id is not None:  # most recently used last: evict() drops from the front
            self.sessions[session_id] = self.sessions.pop(session_id)
        session.spec = spec
        return session

    def _new_session(self, spec: SpecConfig, session_id: str | None) -> Session:
        """A new session. Where the device has no memory left for its cache (graphs.py: caches of fixed size on a
        GPU), the least recently used named sessions go first, one at a time (what they taught the pool stays, as
        in evict); with none left, DeviceMemoryFull (the server's 503). A session a request is still using frees
        its cache when that request ends."""
        while True:
            try:
                return Session(self.path, build_chain(spec, self.shared), session_id)
            except DeviceMemoryFull:
                if not self.sessions:
                    raise
                self.sessions.pop(next(iter(self.sessions)))
                gc.collect()  # its cache goes back to the forward's free list now

    def fork(self, source_id: str, target_id: str, prompt: list[int], spec: SpecConfig | None = None) -> int:
        """Session target_id, new, starts with what session source_id has cached of `prompt` (Session.fork); 0 when
        the source is gone (it ended before) or holds none of it."""
        source = self.sessions.get(source_id)
        target = self.session(target_id, spec)
        return target.fork(source, prompt) if source is not None and source is not target else 0

    DONORS = 8  # the most recently used sessions whose caches a prompt may borrow chunks from (--cache-reuse)

    def donors(self, session_id: str) -> list[Session]:
        """The sessions a session's prompt may borrow cached chunks from (Session.borrowing): the most recently used
        others of its API key's namespace (a name's part up to "|": clients with different keys share nothing)."""
        tenant = namespace(session_id)
        others = [session for name, session in reversed(self.sessions.items())
                  if name != session_id and namespace(name) == tenant]
        return others[: self.DONORS]

    def sessions_info(self, prefix: str = "") -> list[SessionInfo]:
        """The named sessions whose id starts with `prefix`, least recently used first."""
        return [SessionInfo(name, session.length, session.cached, session.nbytes, tuple(session.spec.spec),
                            [stats.copy() for stats in session.chain.stats], session.history)
                for name, session in self.sessions.items() if name.startswith(prefix)]

    def sessions_bytes(self) -> int:
        """The memory every named session holds: KV caches and histories."""
        return sum(session.nbytes for session in self.sessions.values())

    def drop(self, session_id: str, pool: str) -> None:
        """Forget a session. pool="keep": what it taught the shared ngram-mod pool stays (knowledge for every
        session, e.g. a temporary request's or an evicted slot's); pool="forget": the pool takes it back (a
        closed document whose text should no longer be drafted)."""
        if pool not in (KEEP, FORGET):
            raise ValueError(f"pool must be {KEEP!r} or {FORGET!r}, got {pool!r}")
        session = self.sessions.pop(session_id, None)
        if session is not None and pool == FORGET:
            session.reset()

    def teach(self, document_id: str, text: str, version=None) -> None:
        """Let the shared pool learn a document (an open file), so every session can draft from it. Teaching the
        same id again learns only what changed and takes back what the old text taught after the first change."""
        if self.documents.current(document_id, version, self.shared.pool):
            return
        tokens = self.tokenizer(text, add_special_tokens=False).input_ids
        self.documents.teach(document_id, tokens, version, self.shared.pool)

    def forget_document(self, document_id: str) -> None:
        """The shared pool takes back everything the document taught it."""
        self.documents.forget(document_id)

    def evict(self, keep=()) -> list[str]:
        """Drop the least recently used named sessions, except those in `keep` (busy ones), until their KV caches
        fit in session_memory bytes; returns the ids dropped. What they taught the shared ngram-mod pool stays:
        it is knowledge for every session, bounded by the pool's fixed size, not this session's memory."""
        total = self.sessions_bytes()
        dropped = []
        for session_id in list(self.sessions):
            if total <= self.session_memory:
                break
            if session_id in keep:
                continue
            total -= self.sessions.pop(session_id).nbytes  # KEEP: the pool stays (see above)
            dropped.append(session_id)
        return dropped

    def warm(self, prompt: str | list[int], session_id: str | None = None, spec: SpecConfig | None = None,
             chat: bool = False, chunk_tokens: int = 0) -> Iterator[int]:
        """Prefill a session's KV cache with a prompt without generating (llama.vim's `n_predict: 0`), so the next
        request that extends it only feeds the new tokens. A generator: it first yields the prompt tokens reused
        from the session's cache, then the tokens cached after each forward of at most chunk_tokens (0: one
        forward)."""
        return self.drive(self.prefill_steps(prompt, session_id, spec, chat, chunk_tokens))

    def prefill_steps(self, prompt: str | list[int], session_id: str | None = None, spec: SpecConfig | None = None,
                      chat: bool = False, chunk_tokens: int = 0):
        """`warm` for a driver (decode.py): each chunk is a forward request, so a scheduler runs it in one batch
        with other sessions' steps."""
        prompt_ids = self.prompt_ids(prompt, chat)
        session = self.session(session_id, spec or self.spec)
        yield session.prepare(prompt_ids)  # a prompt that diverges from the history truncates the drafters here
        for rows in prefill_rows(session, chunk_tokens):
            yield rows
            yield session.cached

    def drive(self, steps) -> Iterator:
        """Run a generator of requests (decode.py) alone: each forward at once, on this engine's path."""
        return drive(steps, self.path, self._costs)

    @functools.cached_property
    def vocabulary(self) -> Vocabulary:
        """The tokenizer's token strings, for token healing (built on first use: ~0.2 s for 49k tokens)."""
        return Vocabulary(self.tokenizer)

    def heal(self, ids: list[int], keep: int = 0) -> tuple[list[int], str | None]:
        """The prompt backed up over a last token that a longer token could extend, and that token's string
        (healing.heal), for stream_steps(healed=...). The first `keep` tokens stay."""
        return heal(self.vocabulary, ids, keep)

    def prompt_ids(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """The prompt's tokens, checked to be non-empty and to leave room in the context for one more."""
        prompt_ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise CodespecError("the prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise CodespecError(
                f"the prompt is {len(prompt_ids)} tokens but the model's context is {self.context_length}")
        return prompt_ids

    def encode(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        if not text:
            raise CodespecError("the prompt is empty")
        if not chat:
            return list(self.tokenizer(text, add_special_tokens=True).input_ids)
        if not getattr(self.tokenizer, "chat_template", None):
            raise CodespecError("this model has no chat template; drop --chat")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               session_id: str | None = None, spec: SpecConfig | None = None,
               chat: bool = False, reference: list[int] | None = None,
               stop_ids: frozenset[int] = frozenset(), healed: str | None = None) -> Iterator[Chunk]:
        """Generate, yielding text as it becomes final; the last chunk carries the result.
        `reference`: the tokens of a text this generation rewrites, for the edit-align drafter.
        `stop_ids`: tokens that end this generation like an EOS (a FIM format's end-of-middle tokens)."""
        return self.drive(self.stream_steps(prompt, params, session_id, spec, chat, reference, stop_ids,
                                            healed=healed))

    def stream_steps(self, prompt: str | list[int], params: SamplingParams | None = None,
                     session_id: str | None = None, spec: SpecConfig | None = None,
                     chat: bool = False, reference: list[int] | None = None,
                     stop_ids: frozenset[int] = frozenset(), prefill_chunk: int = 0, healed: str | None = None):
        """`stream` for a driver (decode.py): its Chunks, with forward requests in between. prefill_chunk: the
        uncached prompt goes in forwards of at most that many tokens (0: all with the first step). healed: a token
        string (healing.heal) the output must start with; its text is not part of the output."""
        params = params or SamplingParams()
        spec = spec or self.spec
        prompt_ids = self.prompt_ids(prompt, chat)
        session = self.session(session_id, spec)
        before = [s.copy() for s in session.chain.stats]
        stats = GenerationStats()
        constraint = Constraint(self.vocabulary, healed) if healed else None
        text = TextAssembler(self.tokenizer, params.stop, self.vocabulary.text(healed) if healed else "")
        # Seeded sampling must repeat exactly. An n-gram draft is checked by sampling each position in turn, one
        # draw per output token whatever the draft (sampling.verify_sampled_exact): the text is plain sampling's.
        # A draft model's rejection sampling draws by its draft's length: with one in the chain, draft lengths may
        # not depend on timing. (Greedy output never depends on them.)
        adaptive = spec.adaptive and (params.temperature == 0 or params.seed is None
                                      or not any(name in MODEL_DRAFTERS for name in spec.spec))
        if adaptive and session.adaptive is None:
            session.adaptive = Adaptive(self.costs, self.drafting)
        # every generation: one without a reference clears it. With the adaptive budget, a reference's drafts reach
        # up to prediction_draft_max tokens: a followed prediction's are all accepted, and longer ones verify more
        # tokens a forward where the budget finds that pays
        session.chain.set_reference(reference, spec.prediction_draft_max if adaptive else 0)
        if adaptive and reference:  # the caller vouches for it: its drafts start long
            session.adaptive.expect(EditAlign.name)
        steps = decode_steps(session, prompt_ids, Sampler(params), spec.draft_max, params.max_tokens,
                             self.context_length, self.eos_token_ids | stop_ids, stats,
                             session.adaptive if adaptive else None, prefill_chunk, constraint)
        finish_reason = "length"
        logprobs = [] if params.logprobs >= 0 else None
        unsent = []  # the logprobs of steps since the last chunk (a step whose text is held back sends none)
        while (step := (yield from next_output(steps))) is not None:
            if logprobs is not None:
                logprobs += step.logprobs
                unsent += step.logprobs
            delta, stop_at = text.add(step.tokens)
            if stop_at is not None:
                # a stop string ended the text: the tokens after the one that completed it are dropped
                session.truncate(len(prompt_ids) + stop_at)
                stats.generated_tokens = stop_at
                finish_reason = "stop"
                break
            if step.finished:
                finish_reason = step.finished
                delta += text.flush()
                break
            if delta:
                yield Chunk(delta, step.tokens, stats=stats, logprobs=unsent if logprobs is not None else None)
                unsent = []
        stats.drafters = [now.since(then) for now, then in zip(session.chain.stats, before)]
        result = GenerationResult(text.text, text.tokens, finish_reason, stats,
                                  logprobs[: len(text.tokens)] if logprobs is not None else None)
        yield Chunk(delta, step.tokens, result, stats, unsent if logprobs is not None else None)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, **options) -> GenerationResult:
        for chunk in self.stream(prompt, params, **options):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("stream ended without a result")


class TextAssembler:
    """Detokenises generated tokens incrementally, holds back text that could still become a stop
    string or an incomplete UTF-8 character, and finds where a stop string ends the output."""

    def __init__(self, tokenizer, stop: tuple[str, ...], healed: str = ""):
        self.tokenizer = tokenizer
        self.healed = healed  # text the tokens spell first that the prompt already had (token healing)
        self.stop = tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.text = ""  # the output so far (final once generation ends)
        self.sent = 0  # characters already handed out
        self.mark, self.marked = 0, ""  # tokens[:mark] decode to `marked` (raw: before the healed text goes)

    WINDOW = 8  # tokens decoded again before the new ones, so that a tokenizer's joins across them show

    def decode(self, tokens: list[int]) -> str:
        return self.healed_off(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def healed_off(self, text: str) -> str:
        if self.healed.startswith(text):
            return ""
        return text.removeprefix(self.healed)

    def raw(self, end: int) -> str:
        """The decoded text of tokens[:end] (end >= mark), decoding only a few tokens before the mark again: at 512
        tokens a whole decode took 264 us a step, 9% of a 3 ms forward. Where the text of the tokens after the mark
        is not simply appended (a character cut by the mark, a tokenizer's clean-up across it), a whole decode."""
        start = max(self.mark - self.WINDOW, 0)
        overlap = self.tokenizer.decode(self.tokens[start : self.mark], skip_special_tokens=True)
        tail = self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=True)
        if self.mark and tail.startswith(overlap) and not overlap.endswith("\ufffd"):
            return self.marked + tail[len(overlap):]
        return self.tokenizer.decode(self.tokens[:end], skip_special_tokens=True)

    def add(self, tokens: list[int]) -> tuple[str, int | None]:
        """Append tokens; return (text safe to send, token count at which a stop string ended the text)."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        if len(self.tokens) - self.mark > 4 * self.WINDOW:  # the mark follows, WINDOW tokens behind the end
            mark = len(self.tokens) - self.WINDOW
            self.marked, self.mark = self.raw(mark), mark
        self.text = self.healed_off(self.raw(len(self.tokens)))
        for stop in self.stop:
            at = self.text.find(stop, max(0, self.sent - len(stop)))
            if at != -1:
                # the fewest tokens whose text contains the stop string
                count = next(n for n in range(start + 1, len(self.tokens) + 1)
                             if stop in self.decode(self.tokens[:n]))
                self.tokens = self.tokens[:count]
                self.mark, self.marked = 0, ""  # (the mark may lie past the cut)
                self.text = self.text[:at]
                return self.flush(), count
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe -= 1
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:size]):
                    safe = min(safe, len(self.text) - size)
                    break
        return self.take(safe), None

    def take(self, end: int) -> str:
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def flush(self) -> str:
        return self.take(len(self.text))


def check_forward(path, model) -> None:
    """Two tokens through the forward with a cache, a rollback and one more: a model transformers loads but
    that cannot run this way fails here with one line naming its architecture, not in the first request."""
    try:
        cache = path.new_cache()
        path(cache, [1, 2], 1)
        cache.crop(1)
        path(cache, [2], 1)
    except Exception as exc:  # anything the model's own code raises
        names = ", ".join(getattr(model.config, "architectures", None) or [type(model).__name__])
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CodespecError(f"unsupported architecture: {model.config.model_type!r} ({names}) does not run with "
                            f"a key-value cache: {reason}") from None


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
