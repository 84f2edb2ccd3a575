"""`python -m codespec.bench.lsp_latency`: the language server timed the way an editor uses it, over stdio.

1. **Typing.** A standard-library module is open with the cursor halfway through a function. The rest of the
   function is typed: a request after every character (one-line completions), and after each Enter plus the
   next line's indentation a 32-token block completion. The first request prefills the whole prompt (cold);
   every later one reuses the document's session, so a keystroke prefills only the tokens that changed.
   Latency is from sending the edit to receiving the completion, with the debounce set to 0 (a client's
   debounce adds its own wait on top).
2. **Accept** (`--phases accept`). A block suggestion is shown on an empty line, looked at for 3 s, accepted, and
   the editor asks again at the end of it: the latency of that request, answered by accept-ahead when it could be.
3. **Rewrite command.** `codespec.rewriteSelection` on `json.decoder.py_scanstring` (58 lines) with each
   drafter chain, interleaved, each run in a fresh document (so every run prefills the same prompt and starts
   with no acceptance history). Greedy: every chain must produce the identical edit.

`--backend thin` times the thin language server instead (`codespec lsp --server URL`, generating on a
`codespec serve` started on loopback with the same model, or on `--server URL`); `--backend both` runs the
in-process language server, then the thin one (never both at once: two processes with their own torch threads
on one CPU slow each other down), and reports the thin one's p50 and p95 as ratios of the in-process ones.

Holds /tmp/codespec-bench.lock while it runs (and waits for another holder to finish first).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from lsprotocol import types
from pygls.lsp.client import LanguageClient

from .workloads import stdlib_source

LOCK = Path("/tmp/codespec-bench.lock")
TYPING = ("textwrap", "TextWrapper._wrap_chunks")
REWRITE = ("json.decoder", "py_scanstring", "rename the variable chunks to parts")
CHAINS = [("none",), ("prompt-lookup",), ("edit-align",), ("edit-align", "ngram-mod", "prompt-lookup")]


@contextmanager
def bench_lock(enabled: bool):
    if not enabled:
        yield
        return
    while LOCK.exists():
        print(f"waiting for {LOCK} ...", file=sys.stderr)
        time.sleep(30)
    LOCK.touch()
    try:
        yield
    finally:
        LOCK.unlink(missing_ok=True)


class Client:
    """A pygls client that keeps what the server sends on its own: stats and edits."""

    def __init__(self):
        self.lsp = LanguageClient("codespec-bench", "1")
        self.stats: list[dict] = []
        self.edits: list[types.ApplyWorkspaceEditParams] = []
        self.versions: dict[str, int] = {}

        @self.lsp.feature("codespec/stats")
        def on_stats(params):
            # pygls reads params of a method it has no type for as a namedtuple
            self.stats.append(params if isinstance(params, dict) else params._asdict())

        @self.lsp.feature(types.WORKSPACE_APPLY_EDIT)
        def on_edit(params: types.ApplyWorkspaceEditParams):
            self.edits.append(params)
            return types.ApplyWorkspaceEditResult(applied=True)

    async def start(self, server: list[str], settings: dict) -> None:
        await self.lsp.start_io(*server)
        await self.lsp.initialize_async(types.InitializeParams(
            capabilities=types.ClientCapabilities(), initialization_options={"codespec": settings}))
        self.lsp.initialized(types.InitializedParams())

    def configure(self, **settings) -> None:
        self.lsp.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings={"codespec": settings}))

    def open(self, uri: str, text: str) -> None:
        self.versions[uri] = 1
        self.lsp.text_document_did_open(types.DidOpenTextDocumentParams(
            types.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)))

    def close(self, uri: str) -> None:
        self.lsp.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri)))

    def insert(self, uri: str, line: int, character: int, text: str) -> None:
        self.versions[uri] += 1
        at = types.Position(line=line, character=character)
        self.lsp.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=self.versions[uri]),
            content_changes=[types.TextDocumentContentChangePartial(range=types.Range(start=at, end=at), text=text)]))

    async def complete(self, uri: str, line: int, character: int) -> tuple[float, str, dict]:
        before = len(self.stats)
        started = time.perf_counter()
        result = await self.lsp.text_document_inline_completion_async(types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri), position=types.Position(line=line, character=character),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic)))
        elapsed = time.perf_counter() - started
        for _ in range(1000):  # the stats notification is sent just before the answer
            if len(self.stats) > before:
                break
            await asyncio.sleep(0.001)
        else:
            raise RuntimeError("the server answered a completion without a codespec/stats notification")
        return elapsed, (result.items[0].insert_text if result.items else ""), self.stats[-1]

    async def stop(self) -> None:
        await self.lsp.shutdown_async(None)
        self.lsp.exit(None)
        await self.lsp.stop()


def typing_document() -> tuple[str, list[str]]:
    """(the module up to the cursor's line, the lines to type after it)."""
    module, qualname = TYPING
    source = inspect.getsource(importlib.import_module(module))
    body = stdlib_source(module, qualname)
    start = source.index(body.splitlines()[0].strip())
    cut = source.index("\n", start + len(body) // 2) + 1  # a line boundary halfway through the function
    rest = source[cut:].splitlines()[:24]
    return source[:cut], [line for line in rest if line.strip()]


async def typing_latency(client: Client, char_lines: int = 4) -> dict:
    client.open("file:///bench/warmup.py", "x = 1\n")  # the model loads (and times its forwards) here
    await client.complete("file:///bench/warmup.py", 1, 0)
    client.close("file:///bench/warmup.py")
    text, lines = typing_document()
    uri = "file:///bench/textwrap.py"
    client.open(uri, text)
    line = text.count("\n")
    cold, _, cold_stats = await client.complete(uri, line, 0)  # the first request prefills everything
    chars, blocks = [], []
    for number, target in enumerate(lines):
        indent = len(target) - len(target.lstrip())
        client.insert(uri, line, 0, target[:indent])
        blocks.append(await client.complete(uri, line, indent))  # an empty, indented line: a block completion
        if number < char_lines:  # type it character by character, a request after each
            for column in range(indent, len(target)):
                client.insert(uri, line, column, target[column])
                chars.append(await client.complete(uri, line, column + 1))
        else:  # the rest of the lines land whole (as typed between two requests)
            client.insert(uri, line, indent, target[indent:])
        client.insert(uri, line, len(target), "\n")
        line += 1
    client.close(uri)

    def summary(runs):
        latencies = sorted(r[0] for r in runs)
        return {"requests": len(runs), "p50_ms": round(1000 * statistics.median(latencies), 1),
                "p90_ms": round(1000 * latencies[int(0.9 * (len(latencies) - 1))], 1),
                "p95_ms": round(1000 * latencies[round(0.95 * (len(latencies) - 1))], 1),
                "median_tokens": statistics.median(r[2]["generated_tokens"] for r in runs),
                "median_prefilled_tokens": statistics.median(r[2]["prompt_tokens"] - r[2]["cached_tokens"]
                                                             for r in runs),
                "median_prompt_tokens": statistics.median(r[2]["prompt_tokens"] for r in runs),
                "median_tokens_per_forward": statistics.median(r[2]["tokens_per_forward"] for r in runs)}

    return {"cold_ms": round(1000 * cold, 1), "cold_prompt_tokens": cold_stats["prompt_tokens"],
            "block_32": summary(blocks), "per_character": summary(chars)}


async def accept_latency(client: Client, positions: int = 10, think_seconds: float = 3.0) -> dict:
    """Accept-ahead: at each of `positions` empty, indented lines of the typing document, a block suggestion is
    shown, the user looks at it for think_seconds (the server computes what follows accepting it meanwhile), accepts
    it (the suggestion inserted, the cursor after it), and the editor asks again: that request's latency."""
    text, lines = typing_document()
    rows = []
    for number, target in enumerate(lines[:positions]):
        uri = f"file:///bench/accept-{number}.py"
        line = text.count("\n")
        indent = len(target) - len(target.lstrip())
        client.open(uri, text + "".join(f"{previous}\n" for previous in lines[:number]) + target[:indent])
        line += number
        _, shown, _ = await client.complete(uri, line, indent)
        if not shown:
            client.close(uri)
            continue
        await asyncio.sleep(think_seconds)
        client.insert(uri, line, indent, shown)
        end_line = line + shown.count("\n")
        end_column = len(shown.rsplit("\n", 1)[-1]) + (indent if "\n" not in shown else 0)
        elapsed, _, stats = await client.complete(uri, end_line, end_column)
        rows.append({"ms": round(1000 * elapsed, 1), "precomputed": bool(stats.get("precomputed"))})
        client.close(uri)
    latencies = sorted(r["ms"] for r in rows)
    return {"positions": len(rows), "think_seconds": think_seconds, "p50_ms": statistics.median(latencies),
            "p95_ms": latencies[round(0.95 * (len(latencies) - 1))],
            "precomputed": sum(r["precomputed"] for r in rows), "rows": rows}


def rewrite_whole(uri: str, source: str, instruction: str) -> types.ExecuteCommandParams:
    """codespec.rewriteSelection over the whole of a document whose text is `source`."""
    return types.ExecuteCommandParams(command="codespec.rewriteSelection", arguments=[
        {"uri": uri, "range": {"start": {"line": 0, "character": 0}, "end": {"line": source.count("\n"), "character": 0}},
         "instruction": instruction}])


async def rewrite_speed(client: Client, repeats: int) -> dict:
    module, qualname, instruction = REWRITE
    source = stdlib_source(module, qualname)
    end_line = source.count("\n")
    runs: dict[tuple, list] = {chain: [] for chain in CHAINS}
    for repeat in range(repeats):
        for chain in CHAINS:
            client.configure(command_spec=list(chain))
            uri = f"file:///bench/rewrite-{repeat}-{'-'.join(chain)}.py"
            client.open(uri, source)
            started = time.perf_counter()
            result = await client.lsp.workspace_execute_command_async(rewrite_whole(uri, source, instruction))
            elapsed = time.perf_counter() - started
            edit = client.edits[-1].edit.changes[uri][0].new_text
            runs[chain].append((elapsed, result["stats"], edit))
            client.close(uri)
    plain = statistics.median(r[0] for r in runs[("none",)])
    plain_decode = statistics.median(decode_seconds(r[1]) for r in runs[("none",)])
    reference_edit = runs[("none",)][0][2]
    rows = []
    for chain, results in runs.items():
        seconds = statistics.median(r[0] for r in results)
        decode = statistics.median(decode_seconds(r[1]) for r in results)
        rows.append({"chain": ",".join(chain), "seconds": round(seconds, 2),
                     "tokens": results[0][1]["generated_tokens"],
                     "tokens_per_forward": statistics.median(r[1]["tokens_per_forward"] for r in results),
                     "acceptance": statistics.median(r[1]["acceptance"] for r in results),
                     "speedup": round(plain / seconds, 2), "decode_speedup": round(plain_decode / decode, 2),
                     "identical": all(r[2] == reference_edit for r in results)})
    return {"function": f"{module}.{qualname}", "lines": end_line, "instruction": instruction,
            "prompt_tokens": runs[("none",)][0][1]["prompt_tokens"], "repeats": repeats, "rows": rows}


async def contention(client: Client, requests: int = 8) -> dict:
    """A 32-token block completion alone, then while a rewrite command (plain decoding, so it runs long) of another
    document is generating in the same process: the completion's p50 both ways."""
    text, lines = typing_document()
    uri = "file:///bench/contended.py"
    client.open(uri, text)
    line = text.count("\n")
    indent = len(lines[0]) - len(lines[0].lstrip())
    client.insert(uri, line, 0, lines[0][:indent])
    await client.complete(uri, line, indent)  # the document's prompt is cached from here on

    async def block_latencies() -> list[float]:
        return [(await client.complete(uri, line, indent))[0] for _ in range(requests)]

    alone = await block_latencies()
    module, qualname, instruction = REWRITE
    source = stdlib_source(module, qualname)
    client.configure(command_spec=["none"])
    client.open("file:///bench/contender.py", source)
    rewrite = asyncio.ensure_future(client.lsp.workspace_execute_command_async(
        rewrite_whole("file:///bench/contender.py", source, instruction)))
    await asyncio.sleep(2.0)  # the rewrite has its prompt computed and is decoding
    during = await block_latencies()
    still_running = not rewrite.done()
    await rewrite
    client.close(uri)
    p50_alone, p50_during = statistics.median(alone), statistics.median(during)
    return {"requests": requests, "alone_p50_ms": round(1000 * p50_alone, 1),
            "during_rewrite_p50_ms": round(1000 * p50_during, 1), "ratio": round(p50_during / p50_alone, 2),
            "rewrite_still_running_after": still_running}


def decode_seconds(stats: dict) -> float:
    return max(stats["seconds"] - stats["prefill_seconds"], 1e-9)


def run_backends(args) -> dict:
    """The in-process language server, then (its process gone, so the two never share the CPU) the thin one
    against a codespec serve started for it, or against --server."""
    if args.backend == "local":
        return asyncio.run(run(args))
    from .server_load import serve

    in_process = asyncio.run(run(args)) if args.backend == "both" else None
    with serve(args.server, model_args(args)) as http:
        thin = asyncio.run(run(args, str(http.base_url).rstrip("/")))
    if in_process is None:
        return thin
    return {"in_process": in_process, "thin": thin, "thin_vs_in_process": thin_ratios(in_process, thin)}


def thin_ratios(in_process: dict, thin: dict) -> dict:
    """The thin language server's p50 and p95 over the in-process one's, per completion kind."""
    if "typing" not in in_process:
        return {}
    return {key: {f"{q}_ratio": round(thin["typing"][key][f"{q}_ms"] / in_process["typing"][key][f"{q}_ms"], 3)
                  for q in ("p50", "p95")} for key in ("block_32", "per_character")}


def format_report(data: dict) -> str:
    if "thin" in data:
        lines = [f"== {name} ==\n{format_report(data[key])}\n" for key, name in
                 (("in_process", "in-process language server (codespec lsp)"),
                  ("thin", "thin language server (codespec lsp --server, loopback)"))]
        for key, ratios in data["thin_vs_in_process"].items():
            lines.append(f"thin / in process, {key}: p50 {ratios['p50_ratio']}x, p95 {ratios['p95_ratio']}x")
        return "\n".join(lines)
    lines = []
    if "typing" in data:
        typing = data["typing"]
        lines += [f"typing ({TYPING[0]}.{TYPING[1]}, cursor halfway; cold first request {typing['cold_ms']} ms for "
                  f"{typing['cold_prompt_tokens']} prompt tokens)",
                  f"{'completion':<22}{'requests':>9}{'p50 ms':>9}{'p90 ms':>9}{'p95 ms':>9}{'tokens':>8}"
                  f"{'prefilled':>10}{'prompt':>8}{'tok/fwd':>9}"]
        for name, key in (("32-token block", "block_32"), ("one line, per char", "per_character")):
            row = typing[key]
            lines.append(f"{name:<22}{row['requests']:>9}{row['p50_ms']:>9}{row['p90_ms']:>9}{row['p95_ms']:>9}"
                         f"{row['median_tokens']:>8}{row['median_prefilled_tokens']:>10}"
                         f"{row['median_prompt_tokens']:>8}"
                         f"{row['median_tokens_per_forward']:>9.2f}")
        lines.append("")
    if "rewrite" in data:
        rewrite = data["rewrite"]
        lines += [f"rewrite command ({rewrite['function']}, {rewrite['lines']} lines, \"{rewrite['instruction']}\", "
                  f"{rewrite['prompt_tokens']} prompt tokens, median of {rewrite['repeats']})",
                  f"{'chain':<38}{'seconds':>8}{'tokens':>7}{'tok/fwd':>8}{'accept':>7}{'speedup':>8}{'decode':>7}"
                  f"{'same':>5}"]
        for row in rewrite["rows"]:
            lines.append(f"{row['chain']:<38}{row['seconds']:>8}{row['tokens']:>7}{row['tokens_per_forward']:>8.2f}"
                         f"{row['acceptance']:>7.2f}{row['speedup']:>7.2f}x{row['decode_speedup']:>6.2f}x"
                         f"{'yes' if row['identical'] else 'NO':>5}")
        lines.append("")
    if "contention" in data:
        c = data["contention"]
        lines.append(f"32-token block completion, p50 of {c['requests']}: {c['alone_p50_ms']} ms alone, "
                     f"{c['during_rewrite_p50_ms']} ms while a rewrite decodes in the same process ({c['ratio']}x; "
                     f"rewrite still running after: {c['rewrite_still_running_after']})")
    if "accept" in data:
        a = data["accept"]
        lines.append(f"the suggestion after accepting a block suggestion ({a['positions']} positions, "
                     f"{a['think_seconds']} s looking at it first): p50 {a['p50_ms']} ms, p95 {a['p95_ms']} ms, "
                     f"{a['precomputed']} answered by accept-ahead")
    return "\n".join(lines).rstrip()


def model_args(args) -> list[str]:
    return ["--dtype", args.dtype] + (["--model", args.model] if args.model else []) + \
        (["--forward", args.forward] if args.forward else []) + (["--weights", args.weights] if args.weights else [])


async def run(args, server_url: str | None = None) -> dict:
    """One language server's phases: in process, or thin against `server_url`."""
    server = [sys.executable, "-m", "codespec", "lsp"] + (["--server", server_url] if server_url else model_args(args))
    client = Client()
    await client.start(server, {"debounce_ms": 0, "max_tokens": 32, "command_max_tokens": 1024})
    phases = {phase.strip() for phase in args.phases.split(",")}
    data = {"dtype": args.dtype, "model": args.model or "smollm2", "weights": args.weights or "auto",
            "backend": "thin" if server_url else "in process"}
    try:
        if "typing" in phases:
            data["typing"] = await typing_latency(client)
        if "rewrite" in phases:
            data["rewrite"] = await rewrite_speed(client, args.repeats)
        if "contention" in phases:
            data["contention"] = await contention(client)
        if "accept" in phases:
            data["accept"] = await accept_latency(client)
    finally:
        await client.stop()
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codespec.bench.lsp_latency", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--forward", help="lean (default) or transformers")
    parser.add_argument("--weights", help="auto (default), checkpoint or gguf (the GGUF's own blocks)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each rewrite chain (median)")
    parser.add_argument("--out", default="bench-results/lsp-latency.json")
    parser.add_argument("--phases", default="typing,rewrite,contention",
                        help="typing, rewrite (chains side by side), contention (a completion during a rewrite), "
                             "accept (the suggestion after accepting one: accept-ahead)")
    parser.add_argument("--no-lock", action="store_true", help=f"do not wait for or hold {LOCK}")
    parser.add_argument("--backend", choices=("local", "thin", "both"), default="local",
                        help="local: the model in the language server (default); thin: `codespec lsp --server` on "
                             "a codespec serve; both: one after the other, with the thin one's ratios")
    parser.add_argument("--server", metavar="URL", help="thin: this running codespec serve (else one is started "
                                                        "on loopback with --model/--dtype/--forward/--weights)")
    args = parser.parse_args(argv)
    if args.server and args.backend == "local":
        args.backend = "thin"
    with bench_lock(not args.no_lock):
        data = run_backends(args)
    print(format_report(data))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
