"""`codespec lsp --server URL`: generation on a codespec HTTP server instead of a model in this process.

What goes over the wire, and why:

- **Completions: /infill with the prompt's parts**, not a built prompt. The language server picks the prefix
  window (whose start stays put while the user types), the suffix, the enclosing scopes' headers and the other
  files' chunks, and sends them as `input_prefix`, `input_suffix`, `input_extra` and `filename`; the server builds
  the FIM prompt with its own tokenizer and format and fits it to its model's context, exactly as it would in
  process. So the prompt's start is as stable as in process and the server reuses the document's KV cache, and
  the token budget is the server's, who knows the model (this side has no tokenizer: it sizes the other files'
  chunks at CHARS_PER_TOKEN characters a token, a cautious estimate; the server's budget is the hard limit).
- **Commands: /v1/chat/completions**, because the command prompt is a chat turn in the model's template, which
  only the server has (/completion and /v1/completions would need the template, or the tokenizer for token
  ids, on this side). In process the answer is primed with the opening code fence; the chat route cannot prime
  an answer, so the model writes the fence line itself, which is dropped here, and the server stops at the
  closing fence (stop "\n```"), so the edit and its statistics arrive as in process. The selection also goes as
  OpenAI's predicted output (`prediction`): codespec's server hands it to the edit-aligned drafter as its
  reference, so the rewrite is drafted as in process.
- **Sessions**: every document has a stable session name (`session` in the body and the `X-Session-Id` header,
  for gateways that route by it), derived from this language server's instance and the document, so two editors
  with the same paths never share (and thrash) one cache. Closing a document does not drop its server session:
  the server evicts the least recently used sessions when their caches outgrow --session-memory.
- **The shared pool** learns what the editors send: each request's prefix, suffix and other files' chunks
  (input_extra) enter the document's session, whose ngram-mod drafter teaches the server's shared pool, and a
  rewritten selection enters it with the command. There is no route that uploads whole documents: the server
  keeps no per-editor document state to clean up when an editor disappears, and a client can only ever teach
  the pool text it also sends as a prompt.
- **Streaming and cancellation**: responses are server-sent events read as they arrive; leaving the iteration
  or a cancelled task closes the HTTP stream, and the server cancels the job when it sees the connection go.
- **Errors** are JSON-RPC errors (RequestFailed with the server's message); for completions a busy (429),
  unavailable (503) or unreachable server gives an empty result instead (`Unavailable`), since the next
  keystroke asks again.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import AsyncIterator

import httpx
from pygls.exceptions import JsonRpcException

from codespec.stats import GenerationStats

from .backend import REQUEST_FAILED, InfillRequest, Piece, RewriteRequest, Unavailable, limited
from .fim_prompts import CHARS_PER_TOKEN, InfillPrompts, filename_of
from .prompts import FENCE, request_text

API_KEY_ENV = "CODESPEC_API_KEY"
CONNECT_SECONDS = 5.0  # a server that does not accept the connection by then is unreachable
READ_SECONDS = 300.0  # the longest silence inside a response: a queue wait plus a long prompt's prefill
FENCE_LINE_TOKENS = 8  # room for the answer's opening fence line on top of command_max_tokens
TRANSIENT = {429: "busy", 503: "unavailable"}  # statuses a completion answers with an empty result


class RemoteBackend:
    def __init__(self, url: str, prompts: InfillPrompts, api_key: str | None = None, transport=None):
        """prompts: picks (and keeps) the other files' chunks a completion sends. api_key: else $CODESPEC_API_KEY;
        the api_key setting replaces it."""
        self.url = url.rstrip("/")
        self.prompts = prompts
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.instance = uuid.uuid4().hex[:8]  # this language server's share of the session names
        self.transport = transport  # tests: an httpx transport instead of the network
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        """One connection pool (created on the event loop that uses it): a keystroke reuses a kept-alive
        connection instead of connecting again."""
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.url, transport=self.transport,
                                             timeout=httpx.Timeout(READ_SECONDS, connect=CONNECT_SECONDS))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def session_name(self, local_name: str) -> str:
        """The server's name for a session: short, in the characters session names allow, unique per editor."""
        digest = hashlib.sha256(local_name.encode("utf-8", "surrogatepass")).hexdigest()[:20]
        return f"lsp-{self.instance}-{digest}"

    # --- the two generations ------------------------------------------------------------------------------
    def infill(self, request: InfillRequest) -> AsyncIterator[Piece]:
        """The server ends the text at n_predict and the stop strings; the editor's limits (the block's end, the
        suffix) are applied here, to the stream, by the same output filter the server uses."""
        return limited(self._infill(request), request.limits)

    async def _infill(self, request: InfillRequest) -> AsyncIterator[Piece]:
        # other files' chunks sized by characters: the server's tokenizer is not here
        extra = self.prompts.extra_chunks(request, lambda text: -(-len(text) // CHARS_PER_TOKEN))
        body = {"input_prefix": request.prefix, "input_suffix": request.suffix,
                "input_extra": [{"filename": name, "text": text} for name, text in extra],
                "filename": filename_of(request.uri), "n_predict": request.max_tokens, "stop": list(request.stop),
                "stream": True, "cache_prompt": True, **self.speculation(request.session, request.spec)}
        async for event in self.stream("/infill", body, request.session):
            if event.get("stop"):  # the last event: empty content, the whole answer's statistics
                yield Piece(event.get("content", ""), infill_stats(event), final=True)
                return
            yield Piece(event.get("content", ""))
        raise JsonRpcException(code=REQUEST_FAILED, message=f"{self.url} ended the stream before the answer")

    async def rewrite(self, request: RewriteRequest) -> AsyncIterator[Piece]:
        """The model answers the command's chat turn with a code block: its opening fence line is dropped here,
        and the server stops at the closing one (a stop string), so the pieces are the new code, as in process."""
        user, _ = request_text(request.command_id, request.values, request.selection, request.language)
        body = {"messages": [{"role": "user", "content": user}], "stop": ["\n" + FENCE], "stream": True,
                "max_tokens": request.max_tokens + FENCE_LINE_TOKENS,
                "prediction": {"type": "content", "content": request.selection},
                **self.speculation(request.session, request.spec)}
        head = ""  # the answer's first line, until it is known whether it opens a code block
        async for event in self.stream("/v1/chat/completions", body, request.session):
            if event == "[DONE]":
                break
            choice = (event.get("choices") or [{}])[0]
            text = (choice.get("delta") or {}).get("content") or ""
            final = choice.get("finish_reason") is not None  # the last chunk: usage, timings, speculation
            if head is not None:
                head += text
                if "\n" not in head and not final:
                    continue
                first, newline, rest = head.partition("\n")
                text = rest if first.lstrip().startswith(FENCE) else head  # no fence: the answer is the code
                head = None
            if final:
                yield Piece(text, chat_stats(event), final=True)
                return
            yield Piece(text)
        raise JsonRpcException(code=REQUEST_FAILED, message=f"{self.url} ended the stream before the answer")

    def speculation(self, session: str, spec) -> dict:
        return {"session": self.session_name(session), "spec": list(spec.spec), "draft_max": spec.draft_max}

    # --- HTTP ---------------------------------------------------------------------------------------------
    async def stream(self, path: str, body: dict, session: str) -> AsyncIterator:
        """POST `body` and yield each server-sent event's data (JSON-decoded, except OpenAI's final [DONE]).
        Leaving the iteration closes the response, and with it the connection: the server stops the job."""
        headers = {"Accept": "text/event-stream", "X-Session-Id": self.session_name(session)}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            async with self.client().stream("POST", path, json=body, headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise status_error(self.url, response)
                async for data in sse_data(response.aiter_lines()):
                    event = data if data == "[DONE]" else json.loads(data)
                    if isinstance(event, dict) and "error" in event:  # a failure after the stream started
                        raise JsonRpcException(code=REQUEST_FAILED, message=f"{self.url}: {error_message(event)}")
                    yield event
        except httpx.TimeoutException as exc:
            raise Unavailable(f"the codespec server at {self.url} did not answer in time ({type(exc).__name__})") \
                from None
        except httpx.TransportError as exc:  # refused, reset, DNS, ...: the server is not there (now)
            raise Unavailable(f"cannot reach the codespec server at {self.url}: {exc or type(exc).__name__}") \
                from None


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each server-sent event (the text/event-stream format: `data:` lines, joined by newlines,
    end at a blank line; comments and other fields are skipped)."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def error_message(body) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or body)


def status_error(url: str, response: httpx.Response) -> JsonRpcException:
    try:
        message = error_message(response.json())
    except ValueError:
        message = response.text[:200] or response.reason_phrase
    status = response.status_code
    if status == 401:
        return JsonRpcException(code=REQUEST_FAILED, message=(
            f"the codespec server at {url} refused the API key (401): set ${API_KEY_ENV} for the language server "
            f"or the api_key setting ({message})"))
    if status in TRANSIENT:
        return Unavailable(f"the codespec server at {url} is {TRANSIENT[status]} ({status}): {message}")
    return JsonRpcException(code=REQUEST_FAILED, message=f"the codespec server at {url} answered {status}: {message}")


def infill_stats(event: dict) -> GenerationStats:
    return generation_stats(event.get("tokens_evaluated", 0), event.get("tokens_cached", 0),
                            event.get("tokens_predicted", 0), event)


def chat_stats(event: dict) -> GenerationStats:
    usage = event.get("usage") or {}
    return generation_stats(usage.get("prompt_tokens", 0),
                            (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                            usage.get("completion_tokens", 0), event)


def generation_stats(prompt: int, cached: int, generated: int, event: dict) -> GenerationStats:
    """The server's timings and speculation fields as the statistics a local generation reports."""
    timings, speculation = event.get("timings") or {}, event.get("speculation") or {}
    prompt_seconds = timings.get("prompt_ms", 0.0) / 1e3
    return GenerationStats(prompt_tokens=prompt, cached_tokens=cached, generated_tokens=generated,
                           target_forwards=speculation.get("target_forwards", 0),
                           drafted_tokens=speculation.get("drafted_tokens", 0),
                           accepted_tokens=speculation.get("accepted_tokens", 0),
                           prefill_seconds=prompt_seconds,
                           seconds=prompt_seconds + timings.get("predicted_ms", 0.0) / 1e3)
