"""OpenAI's generation routes: /v1/completions (with `suffix`, fill-in-the-middle) and /v1/chat/completions. A request
names this server's model, one of its aliases, or none (else OpenAI's 404); a parameter codespec cannot honour is a
400 that names it. /v1/models is admin.py's."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from ...context.fim import SuffixTrimmer, fim_prompt
from ...errors import CodespecError
from ...request import Prompt
from ..errors import OPENAI_ERRORS, Unsupported
from ..generation import Generation
from ..llamacpp import BUILD_INFO
from ..schemas import ChatRequest, ChatResponse, CompletionRequest, CompletionResponse, OpenAIOptions
from ..state import Server, ServerState
from .common import answer, event_stream, finish, prompt_ids, start, stream_events, streamed

router = APIRouter()


def check_openai(server: ServerState, body: OpenAIOptions) -> None:
    """The model a request names is this one; its parameters are ones codespec can honour."""
    server.check_model(body.model)
    problem = body.unsupported()
    if problem:
        raise Unsupported(*problem)


def usage(run: Generation) -> dict:
    prompt, completion = len(run.prompt.ids), run.stats.generated_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": run.cached},
            "completion_tokens_details": run.prediction_tokens()}


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={**streamed("OpenAI completion chunks (a failure: {\"error\": ...}), then [DONE]"),
                        **OPENAI_ERRORS})
async def completions(body: CompletionRequest, request: Request, server: Server):
    """OpenAI text completion; with `suffix`, fill-in-the-middle. `n_predict` or `max_tokens` 0 only warms
    the session's cache."""
    check_openai(server, body)

    def build(engine, params) -> Prompt:
        if body.suffix is None:
            return Prompt(prompt_ids(engine, body.prompt))
        fim = fim_prompt(engine.tokenizer, body.prompt, body.suffix)
        limits = [SuffixTrimmer(body.suffix)] if fim.format is None and body.suffix.strip() else []
        return Prompt(fim.ids, False, fim.stop_ids, limits)

    run = await start(server.generations, "/v1/completions", body, request, build)
    ident, created, model_name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), server.model_name

    def chunk(text, finish_reason=None, **more):
        return {"id": ident, "object": "text_completion", "created": created, "model": model_name,
                "system_fingerprint": BUILD_INFO,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
                **more}

    def complete(text):
        return chunk(text, run.finish_reason, usage=usage(run), timings=run.timings(),
                     speculation=run.speculation())

    def last():
        usage_only = {"id": ident, "object": "text_completion", "created": created, "model": model_name,
                      "system_fingerprint": BUILD_INFO,
                      "choices": [], "usage": usage(run)}
        return [complete(""), *([usage_only] if body.include_usage else [])]

    if body.stream:  # a warm-up too: an OpenAI client reads a stream (its last chunk, then [DONE])
        return event_stream(stream_events(server.generations, run, chunk, last, done=True))
    return await finish(server.generations, request, run) or answer(complete(run.text), body.response_fields)


@router.post("/v1/chat/completions", response_model=ChatResponse,
             responses={**streamed("OpenAI chat completion chunks (a failure: {\"error\": ...}), then [DONE]"),
                        **OPENAI_ERRORS})
async def chat(body: ChatRequest, request: Request, server: Server):
    """OpenAI chat completion, with the model's chat template. `n_predict` or `max_tokens` 0 only warms the
    session's cache (llama.vim's instruction warm-up)."""
    check_openai(server, body)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in body.messages]

    def build(engine, params) -> Prompt:
        if not getattr(engine.tokenizer, "chat_template", None):
            raise CodespecError("this model has no chat template; use /v1/completions")
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
        return Prompt(list(ids["input_ids"] if isinstance(ids, dict) else ids))

    run = await start(server.generations, "/v1/chat/completions", body, request, build)
    ident, created, model_name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), server.model_name
    first = [True]

    def chunk(delta, finish_reason=None, **more):
        content = {"role": "assistant", "content": delta} if first[0] else {"content": delta}
        first[0] = False
        return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "system_fingerprint": BUILD_INFO,
                "choices": [{"index": 0, "delta": content, "finish_reason": finish_reason}], **more}

    def last():
        usage_only = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_name,
                      "system_fingerprint": BUILD_INFO,
                      "choices": [], "usage": usage(run)}
        return [chunk("", run.finish_reason, usage=usage(run), timings=run.timings(),
                      speculation=run.speculation()), *([usage_only] if body.include_usage else [])]

    if body.stream:  # a warm-up too: an OpenAI client reads a stream (its last chunk, then [DONE])
        return event_stream(stream_events(server.generations, run, chunk, last, done=True))
    return await finish(server.generations, request, run) or answer({
        "id": ident, "object": "chat.completion", "created": created, "model": model_name,
        "system_fingerprint": BUILD_INFO,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": run.text},
                     "finish_reason": run.finish_reason}],
        "usage": usage(run), "timings": run.timings(), "speculation": run.speculation()}, body.response_fields)
