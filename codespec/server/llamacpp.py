"""What llama-server's clients read besides generated text, in llama-server's names: the build string
(`build_info`, OpenAI's `system_fingerprint`), a generation's settings (`generation_settings`, /props'
`default_generation_settings`, each /slots entry's `params`), token pieces as /tokenize spells them, and the
`exceed_context_size_error` a prompt longer than the context gets (tools/server in ggml-org/llama.cpp)."""

from __future__ import annotations

import functools
import re

from .. import __version__
from ..config import SamplingParams, SpecConfig
from ..errors import CodespecError

BUILD_INFO = f"codespec-{__version__}"  # llama-server's is b<build>-<commit>; also OpenAI's system_fingerprint


class ContextExceeded(CodespecError):
    """A prompt of n_prompt_tokens that leaves no room in the context of n_ctx tokens (llama-server refuses one of
    n_ctx tokens or more): llama-server's 400 exceed_context_size_error, which carries both numbers."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        super().__init__(f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens), "
                         "try increasing it")
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


def fitting(build):
    """build(engine) -> Prompt, refusing a prompt that does not fit the context as llama-server does (the request
    layer refuses the same prompts, in its own words)."""
    def checked(engine):
        prompt = build(engine)
        if len(prompt.ids) >= engine.context_length:
            raise ContextExceeded(len(prompt.ids), engine.context_length)
        return prompt
    return checked


def is_speculative(chain: tuple[str, ...]) -> bool:
    """A drafter chain that drafts (not empty, not "none")."""
    return bool(chain) and "none" not in chain


def params_json(params: SamplingParams, spec: SpecConfig, n_predict: int, stream: bool = False, n_indent: int = 0,
                t_max_predict_ms: int = 0) -> dict:
    """A generation's settings in llama-server's names, only those codespec honours (no min_p, penalties, DRY,
    mirostat, ...: codespec does not sample with them), and codespec's drafter chain."""
    return {"n_predict": n_predict, "max_tokens": n_predict, "seed": -1 if params.seed is None else params.seed,
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
            "stop": list(params.stop), "stream": stream, "n_indent": n_indent, "t_max_predict_ms": t_max_predict_ms,
            "speculative.n_max": spec.draft_max, "speculative.n_min": spec.draft_min,
            "speculative.p_min": spec.draft_p_min, "spec": list(spec.spec),
            "logit_bias": [{"token": token, "bias": None if bias == float("-inf") else bias}
                           for token, bias in params.logit_bias]}


def run_settings(run, body) -> dict:
    """A /completion or /infill run's generation_settings: what it ran with (its limit after the server's cap; 0
    for a warm-up)."""
    plan = run.plan
    return params_json(plan.params, plan.spec, 0 if plan.warm_only else plan.params.max_tokens, bool(body.stream),
                       body.n_indent, body.t_max_predict_ms)


def generated_ids(run, tokenizer) -> list[int]:
    """return_tokens: the ids of the tokens the answer's text came from, the engine's where it ended the text (end
    of text, a stop string, the limit; after token healing the first spells again the whitespace the prompt ended
    with, which the content leaves out). Where an output limit of the request layer (n_indent, t_max_predict_ms, the
    suffix) cut the text first, the engine's went with the stopped job: then the returned text's ids as the
    tokenizer spells them."""
    if run.result is not None and not run.limited:
        return list(run.result.tokens[: run.stats.generated_tokens])
    return list(tokenizer(run.text, add_special_tokens=False).input_ids) if run.text else []


# -- /tokenize's pieces ----------------------------------------------------------------------------------------------

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character each byte is written as in a token's string, reversed."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


def byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return False
    from tokenizers import decoders

    return isinstance(decoder, decoders.ByteLevel)


def token_bytes(tokenizer, token_id: int, special: set[int], bytewise: bool) -> bytes:
    """The bytes a token stands for (a special token: its text), as llama.cpp's token_to_piece gives them."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return b""
    if token_id in special:
        return piece.encode("utf-8")
    match = BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match[1], 16)])
    if bytewise:
        table = byte_decoder()
        if all(char in table for char in piece):
            return bytes(table[char] for char in piece)
    return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece writes a space as U+2581


def pieces(tokenizer, ids: list[int]) -> list[dict]:
    """/tokenize's with_pieces: each token's id and piece, the piece a string where its bytes are UTF-8, else the
    list of its bytes (a character split across tokens)."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    bytewise = byte_level(tokenizer)
    out = []
    for token in ids:
        raw = token_bytes(tokenizer, token, special, bytewise)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": token, "piece": piece})
    return out


def chat_template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else ""


class Spelling:
    """Token ids as text and bytes (llama.cpp's token_to_piece), for log-probability answers."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        self.bytewise = byte_level(tokenizer)

    def bytes(self, token: int) -> bytes:
        return token_bytes(self.tokenizer, token, self.special, self.bytewise)

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")


def logprob_entries(tokenizer, logprobs: list, ids: bool = True) -> list[dict]:
    """Each generated token's log-probability and its most likely alternatives, as OpenAI's chat `logprobs.content`
    (ids=False) and llama-server's `completion_probabilities` (with each token's `id`) write them."""
    spell = Spelling(tokenizer)

    def one(token: int, logprob: float) -> dict:
        return {**({"id": token} if ids else {}), "token": spell.text(token), "logprob": logprob,
                "bytes": list(spell.bytes(token))}

    return [{**one(entry.token, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}
            for entry in logprobs]


def completion_logprobs(tokenizer, logprobs: list, offset: int = 0) -> dict:
    """OpenAI's /v1/completions `logprobs`: tokens, their log-probabilities, the alternatives, character offsets
    (from `offset`: the characters a stream's earlier chunks' tokens spelled)."""
    entries = logprob_entries(tokenizer, logprobs)
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}
