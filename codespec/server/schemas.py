"""Request and response bodies. Pydantic checks types and ranges, so a client's mistake is a 4xx JSON error
before anything reaches the engine. Unknown fields are ignored: llama.vim and OpenAI SDKs send fields codespec
does not use (`samplers`, `t_max_prompt_ms`, `user`, ...), and refusing them would break those clients.

The response models are the routes' `response_model`s: FastAPI checks every answer against them, so the OpenAPI
document says what the server really sends."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, field_validator

from ..config import DRAFT_MAX_LIMIT, MAX_LOGIT_BIAS, MAX_LOGPROBS, MIN_TOP_P

MAX_STOP = 16  # stop strings per request (llama.cpp and OpenAI take a handful)
MAX_ALTERNATIVES = 8  # n_cmpl / n: completions of one prompt per request
MAX_BIASES = 1024  # logit_bias entries per request (OpenAI takes 300)
SessionName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\w.:@/-]+$")]


def unicode_text(value: str) -> str:
    """A lone UTF-16 surrogate (JSON's "\\ud800", or the bytes ED A0 80, which Python's JSON decoder lets through)
    is no text: the tokenizer cannot encode it, nor can a response that echoes it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return value


Text = Annotated[str, AfterValidator(unicode_text)]


class Lenient(BaseModel):
    """Unknown fields are ignored; known ones must have their JSON type (strict: `"stream": 0` or `"n_predict": "8"`
    is a 422, as OpenAI's API answers; an integer is still a number)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


class TextPart(Lenient):
    type: Literal["text"] = "text"
    text: Text


MAX_PREDICTION = 1 << 20  # characters of a prediction (a whole file: far more than any context holds)


class Prediction(Lenient):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (the file an edit rewrites). It only drafts
    (the edit-align drafter follows it through insertions and deletions): the answer is what the model writes."""

    type: Literal["content"] = "content"
    content: Annotated[Text, Field(max_length=MAX_PREDICTION)] | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class Speculation(Lenient):
    """codespec's per-request speculation overrides (the server's own settings otherwise)."""

    prediction: Prediction | None = Field(None, description="OpenAI's Predicted Outputs, on every generation route: "
                                                            "{'type': 'content', 'content': text the output is "
                                                            "expected to repeat}; drafts only, never changes the text")

    spec: list[Text] | Text | None = Field(None, description="drafter chain, e.g. ['ngram-mod', 'prompt-lookup'] or "
                                                           "'ngram-mod,prompt-lookup'; 'none' turns speculation off")
    draft_max: int | None = Field(None, ge=1, le=DRAFT_MAX_LIMIT,
                                  validation_alias=AliasChoices("draft_max", "speculative.n_max"))
    draft_min: int | None = Field(None, ge=1, le=DRAFT_MAX_LIMIT,
                                  validation_alias=AliasChoices("draft_min", "speculative.n_min"))
    session: SessionName | None = Field(None, description="a named session: prefix reuse and drafter state follow it")
    id_slot: int = Field(-1, ge=-1, le=1 << 20, description="llama.cpp slot id (session 'slot-N'); -1 picks one")
    cache_prompt: bool = Field(True, description="reuse a session's KV cache; false runs in a fresh session")

    @field_validator("spec")
    @classmethod
    def split_spec(cls, value):
        if isinstance(value, str):
            value = [name.strip() for name in value.split(",") if name.strip()]
        return value


Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)] | Literal[False]
BiasKey = Annotated[Text, Field(min_length=1, max_length=256)]
BiasPair = Annotated[list[int | BiasKey | Bias], Field(min_length=2, max_length=2)]  # llama.cpp's [key, bias]


class Sampling(Lenient):
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="0 = greedy (the default)")
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1.0)
    seed: int | None = Field(None, ge=-1, le=(1 << 63) - 1, description="-1 or absent: unseeded")
    stop: list[Annotated[Text, Field(max_length=256)]] | Text | None = Field(None)
    logit_bias: dict[BiasKey, Bias] | list[BiasPair] | None = Field(
        None, description="added to tokens' logits at every position, in either dialect: OpenAI's {'token id': "
                          "bias} (-100 bans a token, 100 all but forces it) or llama.cpp's [[token id or text, bias "
                          "or false]] (a text's every token; false: never); a key that is not an id is a text")

    @field_validator("logit_bias")
    @classmethod
    def few_biases(cls, value):
        if value is not None and len(value) > MAX_BIASES:
            raise ValueError(f"at most {MAX_BIASES} logit_bias entries")
        for key, bias in value if isinstance(value, list) else ():
            if not isinstance(key, (int, str)) or isinstance(key, bool) or (isinstance(key, int) and key < 0):
                raise ValueError(f"a logit_bias pair starts with a token id or a text, not {key!r}")
            if isinstance(bias, str):
                raise ValueError(f"a logit_bias pair ends with a bias or false, not {bias!r}")
        return value

    def biases(self) -> list[tuple[int | str, float]]:
        """logit_bias as (token id or text, bias) pairs; false is -inf."""
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        return [(int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key,
                 float("-inf") if value is False else float(value)) for key, value in pairs]

    @field_validator("stop")
    @classmethod
    def stop_list(cls, value):
        if isinstance(value, str):
            value = [value]
        if value is not None and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return value


class Output(Lenient):
    """How much to generate and what to answer, read as llama.cpp reads them on every route."""

    n_predict: int | None = Field(None, ge=-1, le=1 << 20,
                                  description="tokens to generate (llama.cpp's name; else max_tokens): 0 only warms "
                                              "the session's cache; -1 or absent: until the end of the text or of "
                                              "the context, at most the server's --n-predict")
    max_tokens: int | None = Field(None, ge=-1, le=1 << 20, description="OpenAI's name for n_predict")
    t_max_predict_ms: int = Field(0, ge=0, le=1 << 31,
                                  description="stop after this long since the first token, once a line is done")
    response_fields: list[Text] | None = Field(None, max_length=256,
                                               description="return only these fields ('a/b' flattens nested ones); "
                                                           "absent or [] returns all (not for streams)")

    def requested_tokens(self) -> int:
        """n_predict, else max_tokens, else -1 (no limit asked for); 0 asks to warm the cache only."""
        return next((value for value in (self.n_predict, self.max_tokens) if value is not None), -1)

    def logprob_count(self) -> int:
        """The most likely alternatives asked for per generated token, with its log-probability (llama.cpp's n_probs,
        OpenAI's completions `logprobs` N and chat `logprobs` with `top_logprobs`); -1: none asked for."""
        if getattr(self, "n_probs", 0):
            return self.n_probs
        logprobs = getattr(self, "logprobs", None)
        if isinstance(logprobs, bool):
            return (getattr(self, "top_logprobs", None) or 0) if logprobs else -1
        return logprobs if logprobs is not None else -1


class ExtraChunk(Lenient):
    filename: Text = Field("", max_length=1024)
    text: Text = ""


class LlamaOutput(Lenient):
    """What only llama.cpp's generation routes (/infill, /completion) answer with."""

    return_tokens: bool = Field(False, description="the generated token ids in `tokens` (else [])")
    n_probs: int = Field(0, ge=0, le=MAX_LOGPROBS, description="each generated token's log-probability and this "
                         "many most likely alternatives, in `completion_probabilities`")
    n_cmpl: int = Field(1, ge=1, le=MAX_ALTERNATIVES, description="alternatives of the completion (llama.vscode "
                        "asks 3): the prompt computed once, they decode together; a list of answers, each with its "
                        "`index`, when above 1")


class InfillRequest(Sampling, Speculation, Output, LlamaOutput):
    """llama.cpp's /infill (what llama.vim sends), plus codespec's speculation overrides."""

    input_prefix: Text = ""
    input_suffix: Text = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list, max_length=1024)
    prompt: Text = Field("", description="the text typed before the cursor on its line (after the prefix)")
    filename: Text | None = Field(None, max_length=1024, description="the current file's name, for repo-level FIM")
    stream: bool = False
    n_indent: int = Field(0, ge=0, le=1 << 16, description="stop at a line indented less than this")


TokenIds = list[Annotated[int, Field(ge=0, lt=1 << 31)]]


def one_prompt(value):
    """One prompt: text or token ids; a one-element list of them is that one."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise ValueError("send one prompt per request")
        value = value[0]
    if isinstance(value, list) and not value:
        raise ValueError("the prompt is empty")
    return value


class LlamaCompletionRequest(Sampling, Speculation, Output, LlamaOutput):
    """llama.cpp's /completion: a prompt (text or token ids) continued, answered as /infill answers."""

    prompt: Text | TokenIds | list[Text] | list[TokenIds] = Field(..., description="text or token ids")
    stream: bool = False
    n_indent: int = Field(0, ge=0, le=1 << 16, description="stop at a line indented less than this")

    check_prompt = field_validator("prompt")(one_prompt)


class StreamOptions(Lenient):
    include_usage: bool | None = Field(None, description="a last chunk with `choices: []` and the usage")


class OpenAIOptions(Lenient):
    """The OpenAI parameters codespec takes, and those it cannot honour: sent with a value that would change the
    answer (penalties, tools, a JSON response_format, echo), they get a 400 that
    names them, never a silently different answer. Others that only concern OpenAI's service (`user`, `store`,
    `metadata`, `service_tier`, ...) are ignored. `prediction` drafts (Speculation)."""

    model: Text | None = Field(None, description="the served model's id (GET /v1/models) or an alias; absent or "
                                                 "empty: the served model")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="only 0 (not supported)")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="only 0 (not supported)")

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, why) for the first parameter whose value codespec cannot honour, else None."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported (only 0)"
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Sampling, Speculation, Output, OpenAIOptions):
    """OpenAI /v1/completions."""

    prompt: Text | TokenIds | list[Text] | list[TokenIds] = Field(
        ..., description="one prompt, text or token ids (a one-element list of them is accepted)")
    suffix: Text | None = Field(None, description="text after the insertion point: fill-in-the-middle")
    best_of: int | None = Field(None, ge=1, le=1, description="one choice per request")
    echo: bool | None = Field(None, description="only false (not supported)")
    logprobs: int | None = Field(None, ge=0, le=5, description="each token's log-probability and this many most "
                                                                "likely alternatives")
    n: int | None = Field(1, ge=1, le=MAX_ALTERNATIVES, description="choices: alternatives of one prompt, computed "
                                                                     "once, decoded together")
    temperature: float | None = Field(None, ge=0.0, le=2.0)

    check_prompt = field_validator("prompt")(one_prompt)

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix is not None and not isinstance(self.prompt, str):
            return "suffix", "a suffix needs a text prompt"
        return super().unsupported()


class ChatMessage(Lenient):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(Sampling, Speculation, Output, OpenAIOptions):
    """OpenAI /v1/chat/completions (and llama.vim's instructions: `n_predict`, `id_slot`, `response_fields`)."""

    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=-1, le=1 << 20,
                                   validation_alias=AliasChoices("max_tokens", "max_completion_tokens"),
                                   description="OpenAI's name for n_predict (also max_completion_tokens)")
    logprobs: bool | None = Field(None, description="each token's log-probability (with top_logprobs alternatives)")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="most likely alternatives per token, with logprobs")
    response_format: dict[str, Any] | None = Field(None, description='only {"type": "text"}')
    tools: list[dict[str, Any]] | None = Field(None, description="only none (not supported)")
    functions: list[dict[str, Any]] | None = Field(None, description="only none (not supported)")
    tool_choice: Text | dict[str, Any] | None = Field(None, description='only "none" or "auto"')
    function_call: Text | dict[str, Any] | None = Field(None, description='only "none" or "auto"')
    audio: dict[str, Any] | None = Field(None, description="not supported")
    modalities: list[Text] | None = Field(None, description='only ["text"]')
    n: int | None = Field(1, ge=1, le=MAX_ALTERNATIVES, description="choices: alternatives of one prompt, computed "
                                                                     "once, decoded together")
    temperature: float | None = Field(None, ge=0.0, le=2.0)

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", f"response_format {self.response_format.get('type')!r} is not supported " \
                                      "(only 'text')"
        for name in ("tools", "functions"):
            if getattr(self, name):
                return name, f"{name} are not supported"
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                return name, f"{name} {getattr(self, name)!r} is not supported (no tools)"
        if self.audio is not None or any(kind != "text" for kind in self.modalities or ()):
            return "modalities", "only text output is supported"
        return super().unsupported()


# -- responses --------------------------------------------------------------------------------------------------


class Timings(BaseModel):
    prompt_n: int  # prompt tokens computed (not reused from the cache)
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    cache_n: int  # prompt tokens reused from the cache (tokens_cached)
    draft_n: int  # draft tokens verified (speculation's drafted_tokens)
    draft_n_accepted: int  # of those, accepted


class SpeculationStats(BaseModel):
    spec: list[str]
    target_forwards: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    tokens_per_forward: float
    drafters: list[dict[str, Any]]


class LogitBias(BaseModel):
    token: int
    bias: float | None = Field(description="null: never (false, -inf)")


class LlamaParams(BaseModel):
    """A generation's settings in llama-server's names (generation_settings, /props, /slots' params): only those
    codespec samples with, and its drafter chain."""

    model_config = ConfigDict(populate_by_name=True)

    n_predict: int = Field(description="tokens at most (-1: to the end of the text or the context; 0: a warm-up)")
    max_tokens: int = Field(description="n_predict, as llama-server repeats it")
    seed: int = Field(description="-1: unseeded")
    temperature: float
    top_k: int
    top_p: float
    stop: list[str]
    stream: bool
    n_indent: int
    t_max_predict_ms: int
    speculative_n_max: int = Field(alias="speculative.n_max")
    speculative_n_min: int = Field(alias="speculative.n_min")
    speculative_p_min: float = Field(alias="speculative.p_min")
    spec: list[str] = Field(description="codespec's drafter chain")
    logit_bias: list[LogitBias] = Field(default_factory=list)


class GenerationSettings(LlamaParams):
    n_ctx: int = Field(description="the context, prompt and output (llama.vscode's status bar reads it here)")


class InfillResponse(BaseModel):
    index: int = 0  # which alternative (n_cmpl)
    completion_probabilities: list[dict[str, Any]] | None = None  # with n_probs: each token's, llama-server's shape
    content: str
    stop: bool
    stop_type: Literal["eos", "limit", "word", "none"]
    stopping_word: str
    tokens_predicted: int
    tokens_evaluated: int
    tokens_cached: int  # prompt tokens reused from the session's cache (only ever this key's own history)
    truncated: bool
    model: str
    session: str | None
    timings: Timings
    speculation: SpeculationStats
    has_new_line: bool  # the generated text holds a newline
    generation_settings: GenerationSettings
    tokens: list[int]  # the generated token ids with `return_tokens: true`, else []


# with response_fields: only the fields asked for, a nested one under its path ('timings/prompt_n')
SelectedFields = Annotated[dict[str, Any], Field(title="InfillResponse, response_fields only")]


class CachedTokens(BaseModel):
    cached_tokens: int


class PredictionTokens(BaseModel):
    accepted_prediction_tokens: int  # output tokens drafted from the prediction and accepted
    rejected_prediction_tokens: int  # tokens drafted from the prediction that the model did not write there


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens
    completion_tokens_details: PredictionTokens


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: dict[str, Any] | None = None  # with `logprobs`: tokens, token_logprobs, top_logprobs, text_offset
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str  # codespec's build, as llama-server's build_info
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings
    speculation: SpeculationStats


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    logprobs: dict[str, Any] | None = None  # with `logprobs: true`: {"content": [{token, logprob, bytes, top_logprobs}]}
    finish_reason: str | None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str  # codespec's build, as llama-server's build_info
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    speculation: SpeculationStats


class ModelMeta(BaseModel):
    context_length: int
    spec: list[str]
    vocab_size: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    meta: ModelMeta


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Slot(BaseModel):
    id: int = Field(description="its place in this list (llama-server's slot index)")
    session: str = Field(description="the session's name ('slot-N' for id_slot N, or a named session)")
    busy: bool
    tokens: int
    cached: int
    cache_bytes: int
    spec: list[str]
    drafters: list[dict[str, Any]]
    # llama-server's
    n_ctx: int
    is_processing: bool = Field(description="busy")
    speculative: bool = Field(description="its drafter chain drafts")
    params: LlamaParams = Field(description="the server's defaults with the session's drafter chain (codespec keeps "
                                            "no request's settings with a session)")


class Health(BaseModel):
    status: Literal["ok"]


class ErrorDetail(BaseModel):
    code: int | str = Field(description="the HTTP status; OpenAI's code for an unknown model (model_not_found)")
    message: str
    type: str
    param: str | None = Field(None, description="the request parameter at fault, where there is one")
    detail: list[dict[str, Any]] | None = Field(None, description="an invalid body (422; 400 on llama.cpp's "
                                                                  "routes): each problem's loc, msg and type")
    n_prompt_tokens: int | None = Field(None, description="exceed_context_size_error: the prompt's tokens")
    n_ctx: int | None = Field(None, description="exceed_context_size_error: the context's tokens")


class ErrorResponse(BaseModel):
    error: ErrorDetail


# -- llama-server's utility routes: /tokenize, /detokenize, /apply-template, /props ---------------------------------


class TokenizeRequest(Lenient):
    content: Text = Field(..., description="the text to tokenize")
    add_special: bool = Field(False, description="add the tokenizer's special tokens (BOS) as a prompt gets them")
    parse_special: bool = Field(True, description="false: special tokens' text is plain text")
    with_pieces: bool = Field(False, description="each token as {id, piece}")


class TokenPiece(BaseModel):
    id: int
    piece: str | list[int] = Field(description="the token's text, or its bytes where they are not UTF-8 by "
                                                "themselves")


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[TokenPiece]


class DetokenizeRequest(Lenient):
    tokens: list[Annotated[int, Field(ge=0, lt=1 << 31)]] = Field(..., max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    content: str


class ApplyTemplateRequest(Lenient):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)


class ApplyTemplateResponse(BaseModel):
    prompt: str


class DefaultGenerationSettings(BaseModel):
    id: int
    id_task: int
    n_ctx: int = Field(description="the engine's context length, prompt and output")
    speculative: bool
    is_processing: bool
    params: LlamaParams


class Modalities(BaseModel):
    vision: bool
    audio: bool


class Props(BaseModel):
    default_generation_settings: DefaultGenerationSettings
    total_slots: int = Field(description="requests generating at once (--parallel)")
    model_path: str
    model_alias: str = Field(description="the name every answer reports (--alias)")
    chat_template: str
    modalities: Modalities
    build_info: str
    is_sleeping: bool
