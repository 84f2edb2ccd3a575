"""OpenAI's generation routes: /v1/completions (with `suffix`, fill-in-the-middle) and /v1/chat/completions. A request
names this server's model, one of its aliases, or none (else OpenAI's 404); a parameter codespec cannot honour is a
400 that names it. /v1/models is admin.py's."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from fastapi import APIRouter, Request

from ...context.fim import SuffixTrimmer, fim_prompt
from ...errors import CodespecError
from ...request import Prompt
from ..errors import OPENAI_ERRORS, Unsupported
from ..generation import Generation
from ..llamacpp import BUILD_INFO, completion_logprobs, logprob_entries
from ..schemas import ChatRequest, ChatResponse, CompletionRequest, CompletionResponse, OpenAIOptions
from ..state import Server, ServerState
from .common import (Unsent, answer, event_stream, finish_all, merged, prompt_ids, sse, start_all, stream_events,
                     streamed)

router = APIRouter()


def check_openai(server: ServerState, body: OpenAIOptions) -> None:
    """The model a request names is this one; its parameters are ones codespec can honour."""
    server.check_model(body.model)
    problem = body.unsupported()
    if problem:
        raise Unsupported(*problem)


def usage(runs: list[Generation]) -> dict:
    """OpenAI's usage of a request's alternatives (n): the prompt once, every alternative's tokens."""
    prompt, completion = len(runs[0].prompt.ids), sum(run.stats.generated_tokens for run in runs)
    predicted = [run.prediction_tokens() for run in runs]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": runs[0].cached},
            "completion_tokens_details": {key: sum(p[key] for p in predicted) for key in predicted[0]}}


async def respond(server: ServerState, request: Request, body, runs: list[Generation], head: dict, kind: str,
                  choice: Callable, delta: Callable):
    """The answer to an OpenAI request with len(runs) alternatives: whole, {**head, "object": kind, choices: each
    run's choice(index, run), usage, ...}; or streamed, each run's pieces as delta(index, text, finish_reason)
    chunks of object `kind`.chunk, each alternative's last one with its finish reason, then the usage (with
    stream_options.include_usage) and [DONE]. The first run's timings and speculation come along, as codespec's."""
    def extras(run: Generation) -> dict:
        return {"timings": run.timings(), "speculation": run.speculation()}

    if body.stream:  # a warm-up too: an OpenAI client reads a stream (its last chunk, then [DONE])
        def chunk(choice_delta: dict, **more) -> dict:
            return {**head, "object": f"{kind}.chunk", "choices": [choice_delta], **more}

        def events(run: Generation, indexes: list[int]):  # (greedy alternatives: one run, several indexes)
            def last() -> list[dict]:  # (alone, the last chunk has the usage too)
                alone = {"usage": usage(runs)} if len(runs) == 1 else {}
                return [chunk(delta(index, "", run.finish_reason), **alone, **extras(run)) for index in indexes]
            return stream_events(server.generations, run,
                                 lambda text: [chunk(delta(index, text, None)) for index in indexes], last,
                                 done=False)

        async def stream():
            async for event in merged([events(run, indexes) for run, indexes in server.generations.runs_of(runs)]):
                yield event
            if body.include_usage:
                yield sse({**head, "object": f"{kind}.chunk", "choices": [], "usage": usage(runs)})
            yield sse("[DONE]")
        return event_stream(stream())
    return await finish_all(server.generations, request, runs) or answer(
        {**head, "object": kind, "choices": [choice(index, run) for index, run in enumerate(runs)],
         "usage": usage(runs), **extras(runs[0])}, body.response_fields)


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

    runs = await start_all(server.generations, "/v1/completions", body, request, build, body.n or 1)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": server.model_name,
            "system_fingerprint": BUILD_INFO}

    unsent = Unsent()

    def logprobs(index: int, run: Generation, whole: bool) -> dict | None:
        if body.logprob_count() < 0:
            return None
        if whole:
            return completion_logprobs(server.engine.tokenizer, run.token_logprobs)
        return unsent.completion(index, run, server.engine.tokenizer)

    def choice(index: int, run: Generation, text: str | None = None, finish_reason=None) -> dict:
        return {"text": run.text if text is None else text, "index": index,
                "logprobs": logprobs(index, run, whole=text is None),
                "finish_reason": run.finish_reason if text is None else finish_reason}

    return await respond(server, request, body, runs, head, "text_completion", choice,
                         lambda index, text, finish_reason: choice(index, runs[index], text, finish_reason))


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

    runs = await start_all(server.generations, "/v1/chat/completions", body, request, build, body.n or 1)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": server.model_name,
            "system_fingerprint": BUILD_INFO}
    started: set[int] = set()  # alternatives whose first delta went (it carries the role)

    unsent = Unsent()

    def logprobs(entries: list) -> dict | None:
        if body.logprob_count() < 0:
            return None
        return {"content": logprob_entries(server.engine.tokenizer, entries, ids=False)}

    def delta(index: int, text: str, finish_reason) -> dict:
        content = {"content": text} if index in started else {"role": "assistant", "content": text}
        started.add(index)
        return {"index": index, "delta": content, "finish_reason": finish_reason,
                "logprobs": logprobs(unsent.take(index, runs[index]))}

    return await respond(server, request, body, runs, head, "chat.completion",
                         lambda index, run: {"index": index, "message": {"role": "assistant", "content": run.text},
                                             "logprobs": logprobs(run.token_logprobs),
                                             "finish_reason": run.finish_reason}, delta)
