"""llama.cpp's generation routes: /infill (llama.vim's fill-in-the-middle) and /completion, answered in
llama-server's fields (content, stop_type, tokens_cached, timings, ...) and codespec's speculation statistics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...context.fim import SuffixTrimmer, fim_prompt, prompt_budget
from ...request import LLAMA_CPP, BlockLimit, Prompt
from ..errors import LLAMA_CPP_ERRORS
from ..generation import Generation
from ..llamacpp import generated_ids, logprob_entries, run_settings
from ..schemas import InfillRequest, InfillResponse, LlamaCompletionRequest, SelectedFields
from ..state import Server, ServerState
from .common import (Unsent, answer, event_stream, finish_all, merged, prompt_ids, select_fields, start_all,
                     stream_events, streamed)

router = APIRouter()
RESPONSES = {**streamed('{"content": piece, "stop": false} events, then the InfillResponse with empty content; a '
                        'failure: {"error": ...}'),
             **LLAMA_CPP_ERRORS}


def infill_body(server: ServerState, run: Generation) -> dict:
    return {"content": run.text, "stop": True, "stop_type": run.stop_type, "stopping_word": run.stop_word,
            "tokens_predicted": run.stats.generated_tokens, "tokens_evaluated": len(run.prompt.ids),
            "tokens_cached": run.cached, "truncated": run.prompt.truncated, "model": server.model_name,
            "session": None if run.temporary else run.session_name, "timings": run.timings(),
            "speculation": run.speculation()}


def llama_fields(server: ServerState, run: Generation, body) -> dict:
    """llama-server's fields that clients read beside the text: whether it holds a newline, the settings it ran
    with, and its token ids (with return_tokens)."""
    return {"has_new_line": "\n" in run.text,
            "generation_settings": {**run_settings(run, body), "n_ctx": server.engine.context_length},  # (llama.vscode's
            # status bar reads generation_settings.n_ctx)
            "tokens": generated_ids(run, server.engine.tokenizer) if body.return_tokens else []}


async def llama_answer(server: ServerState, runs: list[Generation], body, request: Request):
    """/infill's and /completion's answer: streamed as {"content": piece} events, or whole; a warm-up is never
    a stream (llama.vim reads its answer as JSON). With n_cmpl alternatives, as llama-server: a whole answer is a
    list of them, each with its `index`, and each streamed event has its alternative's `index`."""
    unsent = Unsent()

    def probabilities(entries: list) -> dict:
        return {"completion_probabilities": logprob_entries(server.engine.tokenizer, entries)} if body.n_probs else {}

    def whole(index: int, run: Generation, entries: list | None = None) -> dict:
        """entries: the log-probabilities it carries (None: all of the run's)."""
        return {**infill_body(server, run), **llama_fields(server, run, body), "index": index,
                **probabilities(run.token_logprobs if entries is None else entries)}

    groups = server.generations.runs_of(runs)
    if body.stream and not runs[0].plan.warm_only:  # (n_probs: each event has its tokens' probabilities)
        def events(run: Generation, indexes: list[int]):
            return stream_events(server.generations, run,
                                 lambda delta: [{"content": delta, "stop": False, "index": i,
                                                 **probabilities(unsent.take(i, run))} for i in indexes],
                                 lambda: [{**whole(i, run, unsent.take(i, run)), "content": ""} for i in indexes],
                                 done=False)
        streams = [events(run, indexes) for run, indexes in groups]
        return event_stream(streams[0] if len(streams) == 1 else merged(streams))
    stopped = await finish_all(server.generations, request, runs)
    if stopped is not None:
        return stopped
    if len(runs) == 1:
        return answer(whole(0, runs[0]), body.response_fields, InfillResponse)
    return JSONResponse([select_fields(whole(index, run), body.response_fields) for index, run in enumerate(runs)])


@router.post("/infill", response_model=InfillResponse | list[InfillResponse] | SelectedFields,
             responses=RESPONSES)
async def infill(body: InfillRequest, request: Request, server: Server):
    """llama.cpp's fill-in-the-middle endpoint (llama.vim's). `n_predict: 0` only warms the session's cache."""
    extra = [(chunk.filename, chunk.text) for chunk in body.input_extra]

    def build(engine, params) -> Prompt:
        # the context the text may need: what was asked for, else a little (generation ends at the context)
        requested = body.requested_tokens()
        budget = prompt_budget(engine.context_length, params.max_tokens if requested else 0, limited=requested > 0)
        # healed: a cursor on an empty line or inside a name starts the suggestion where a person expects
        fim = fim_prompt(engine.tokenizer, body.input_prefix + body.prompt, body.input_suffix, extra,
                         body.filename, max_tokens=budget, vocabulary=engine.vocabulary)
        limits = []
        if fim.format is None and body.input_suffix.strip():
            limits.append(SuffixTrimmer(body.input_suffix))  # no FIM tokens: stop where it meets the suffix
        if body.n_indent:
            limits.append(BlockLimit(body.n_indent, LLAMA_CPP))
        return Prompt(fim.ids, fim.truncated, fim.stop_ids, limits, fim.healed)

    runs = await start_all(server.generations, "/infill", body, request, build, body.n_cmpl)
    return await llama_answer(server, runs, body, request)


@router.post("/completion", response_model=InfillResponse | list[InfillResponse] | SelectedFields,
             responses=RESPONSES)
async def completion(body: LlamaCompletionRequest, request: Request, server: Server):
    """llama.cpp's own completion endpoint: the prompt (text or token ids) continued, answered as /infill is.
    `n_predict: 0` only warms the session's cache."""
    def build(engine, params) -> Prompt:
        limits = [BlockLimit(body.n_indent, LLAMA_CPP)] if body.n_indent else []
        return Prompt(prompt_ids(engine, body.prompt), limits=limits)

    runs = await start_all(server.generations, "/completion", body, request, build, body.n_cmpl)
    return await llama_answer(server, runs, body, request)
