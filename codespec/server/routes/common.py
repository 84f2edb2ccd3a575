"""What the generation routes share: starting a route's generation, answering it whole (finish, answer) or as
server-sent events (stream_events), llama.cpp's response_fields, and a prompt's tokens."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event

from ...errors import CodespecError, DeviceMemoryFull
from ...request import Prompt
from ..errors import Unsupported, error_body
from ..generation import Generation, Generations, Plan
from ..llamacpp import completion_logprobs

log = logging.getLogger("codespec.server")


def streamed(description: str) -> dict:
    """The OpenAPI entry of a route's `stream: true` answer: server-sent events (the schema is one event's), each
    event's data a JSON object or the final [DONE]."""
    json_object = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"type": "object"}}
    event = {"type": "object", "required": ["data"], "description": description,
             "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_object]}}}
    return {200: {"content": {"text/event-stream": {"schema": event}},
                  "description": "JSON, or with `stream: true` server-sent events"}}


def tenant(request: Request) -> str:
    """The session namespace of the request's API key ('' with none or one key)."""
    return getattr(request.state, "tenant", "")


async def start(generations: Generations, route: str, body, request: Request, build) -> Generation:
    """The route's generation: the server's settings with the body's, its session (in the API key's namespace),
    and its prompt, build(engine, params) -> Prompt on the engine's worker."""
    return await generations.start(plan(generations, route, body, request, build))


async def start_all(generations: Generations, route: str, body, request: Request, build, count: int
                    ) -> list[Generation]:
    """`count` alternatives of the route's generation (Generations.start_all)."""
    return await generations.start_all(plan(generations, route, body, request, build), count)


def plan(generations: Generations, route: str, body, request: Request, build) -> Plan:
    params, spec = generations.settings(body)
    namespace = tenant(request)
    prediction = body.prediction.text() if body.prediction is not None else None
    if prediction is not None and "none" not in spec.spec and "edit-align" not in spec.spec:
        # the prediction's drafter first: where the output follows the prediction its drafts run long; where the
        # output has left it, its guesses are tentative and the n-gram drafters draft first (edit_align.CONFIRMED)
        spec = replace(spec, spec=("edit-align", *spec.spec))

    def built(engine) -> Prompt:
        prompt = build(engine, params)
        if prediction is not None:
            prompt.reference = engine.tokenizer.encode(prediction, add_special_tokens=False)
        return prompt

    return Plan(route, built, params, spec, generations.session_name(body, namespace), body.cache_prompt,
                body.requested_tokens() == 0, body.t_max_predict_ms, namespace)


# -- a whole answer ----------------------------------------------------------------------------------------------


async def finish(generations: Generations, request: Request, run: Generation) -> Response | None:
    """Collect a run while watching the client; None when it completed, a 499 when the client left."""
    return await finish_all(generations, request, [run])


async def finish_all(generations: Generations, request: Request, runs: list[Generation]) -> Response | None:
    """Collect runs together (alternatives of one request; a run listed twice is collected once) while watching
    the client, as `finish`."""
    collecting = asyncio.ensure_future(asyncio.gather(*(generations.collect(run)
                                                        for run, _ in generations.runs_of(runs))))
    watching = asyncio.ensure_future(disconnected(request))
    done, _ = await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    if collecting in done:
        watching.cancel()
        collecting.result()  # re-raises the engine's error
        return None
    collecting.cancel()  # its cleanup cancels the job: the slot is free at the next step boundary
    try:
        await collecting
    except asyncio.CancelledError:
        pass
    return Response(status_code=499)


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def answer(body: dict, fields: list[str] | None, model=None):
    """A whole (not streamed) answer, checked against `model` where the route's response model is a union; or
    llama.cpp's response_fields selection of it (not checked: the union would take a broken body for one)."""
    if fields:
        return JSONResponse(select_fields(body, fields))
    return model.model_validate(body) if model is not None else body


def select_fields(body: dict, fields: list[str] | None) -> dict:
    """llama.cpp's response_fields: only these fields, a nested one ('timings/prompt_n') under its path; none or []:
    every field (as llama.cpp)."""
    if not fields:
        return body
    selected = {}
    for path in fields:
        value, found = body, bool(path)
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                found = False
                break
            value = value[key]
        if found:
            selected[path] = value
    return selected


# -- a streamed answer -------------------------------------------------------------------------------------------


def sse(data) -> bytes:
    return format_sse_event(data_str=data if isinstance(data, str) else json.dumps(data))


def error_event(status: int, message: str, kind: str) -> bytes:
    return sse(error_body(status, message, kind))


def event_stream(events) -> EventSourceResponse:
    return EventSourceResponse(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_events(generations: Generations, run: Generation, piece: Callable[[str], dict | list[dict]],
                        last: Callable[[], list[dict]], done: bool) -> AsyncIterator[bytes]:
    """SSE: one event per text piece (or several: piece's list), then the last ones; `data: [DONE]` after them for OpenAI routes. The status
    line is sent already when something fails: the error is the last event (then [DONE]), not a cut stream."""
    try:
        async for delta in generations.deltas(run):
            event = piece(delta)
            for one in event if isinstance(event, list) else [event]:  # (a run that answers several alternatives)
                yield sse(one)
        for event in last():
            yield sse(event)
    except DeviceMemoryFull as exc:
        yield error_event(503, str(exc), "server_error")
    except CodespecError as exc:
        yield error_event(400, str(exc), "invalid_request_error")
    except Exception as exc:
        log.exception("a streamed generation failed")
        yield error_event(500, f"internal server error ({type(exc).__name__}); the server's log has the "
                               "details", "server_error")
    if done:
        yield sse("[DONE]")


class Unsent:
    """A stream's log-probabilities not sent yet, per alternative index: each chunk carries those of the tokens
    generated since the one before (an entry can come a chunk ahead of its text, which a stop string holds back
    until it is sure), and the last chunk the rest, so that a stream's chunks together carry the whole answer's."""

    def __init__(self):
        self.sent: dict[int, int] = {}  # index -> entries sent
        self.chars: dict[int, int] = {}  # index -> characters their tokens spell (OpenAI's text_offset)

    def take(self, index: int, run: Generation) -> list:
        entries = run.token_logprobs
        start = self.sent.get(index, 0)
        self.sent[index] = max(start, len(entries))
        return entries[start:]

    def completion(self, index: int, run: Generation, tokenizer) -> dict:
        """The next chunk's /v1/completions `logprobs`: the unsent entries, their text_offset counted on from the
        characters the index's earlier chunks' tokens spelled."""
        offset = self.chars.get(index, 0)
        chunk = completion_logprobs(tokenizer, self.take(index, run), offset)
        self.chars[index] = offset + sum(len(token) for token in chunk["tokens"])
        return chunk


async def merged(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The events of several streams (alternatives of one request) as they come; when the client goes, every
    stream is closed (and so every job cancelled)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream):
        try:
            async for event in stream:
                await queue.put(event)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            event = await queue.get()
            if event is None:
                remaining -= 1
            else:
                yield event
    finally:
        for task in tasks:
            task.cancel()


# -- prompts -------------------------------------------------------------------------------------------------------


def prompt_ids(engine, prompt: str | list[int]) -> list[int]:
    """A prompt's tokens: text exactly as `codespec generate` tokenises it; token ids checked to be in the
    vocabulary."""
    if isinstance(prompt, str):
        return engine.encode(prompt)  # raises "the prompt is empty" for ""
    vocabulary = int(engine.model.config.vocab_size)
    outside = next((token for token in prompt if token >= vocabulary), None)
    if outside is not None:
        raise Unsupported("prompt", f"token id {outside} is outside the vocabulary (0..{vocabulary - 1})")
    return list(prompt)
