"""`python -m codespec.bench.soak`: a long run of a real `codespec serve` (and `codespec lsp`) under editor traffic, to
see what a day of use would do: errors, latency, and whether memory levels off.

Each simulated editor types through its own standard-library module the way llama.vim drives a server: an /infill
on its own slot (`id_slot`) every half to two seconds, the cursor a few characters further each time, so the prefix
grows and the slot's cache is reused; `input_extra` carries a ring of chunks from other files, refreshed now and then
with a cache-warming request (`n_predict: 0`). Now and then an editor asks a chat question instead. One language
server client opens documents and asks for inline completions over stdio.

Every --sample-seconds: the server's and the language server's RSS, and from /slots and /metrics the sessions, their
KV-cache bytes (those of busy sessions apart) against --session-memory, queue depth and active generations. At the end,
per route: requests, errors by status, p50/p95 latency; and the samples as a table. Written to --out as JSON and text.

    python -m codespec.bench.soak --editors 16 --minutes 10 --out docs/benchmarks/soak

--malloc glibc runs the server with glibc's default (dynamic) mmap threshold, to compare with the fixed one
(codespec/cli/memory.py) that the default run sets.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psutil

from ..config import SESSION_MEMORY
from .server_load import wait_until_healthy

MODULES = ("textwrap", "json.decoder", "argparse", "difflib", "csv", "shlex", "calendar", "heapq", "string",
           "fractions", "statistics", "tokenize", "pprint", "configparser", "ast", "dataclasses")
PREFIX_LINES = 64  # lines before the cursor's line in input_prefix (llama.vim's n_prefix is 256; 2 cores are slow)
SUFFIX_LINES = 16  # lines after it in input_suffix (llama.vim: 64)
RING_CHUNKS, CHUNK_LINES = 4, 32  # input_extra: chunks of other files (llama.vim: 16 chunks of 64 lines)
N_PREDICT = (32, 48, 64)  # tokens asked per completion, picked at random
THINK_SECONDS = (0.5, 2.0)  # an editor waits this long (uniform) between its requests: typing
CHAT_SHARE = 0.03  # share of an editor's requests that are a chat question instead of an /infill
RING_SHARE = 0.15  # share of line changes that refresh the ring (followed by a cache-warming request)
LSP_SECONDS = 5.0  # the language server client asks for an inline completion this often


def module_lines(name: str) -> list[str]:
    return inspect.getsource(importlib.import_module(name)).splitlines(keepends=True)


class Log:
    """Every request's route, outcome (HTTP status or exception name) and seconds, from every thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.rows: list[tuple[str, str, float]] = []

    def add(self, route: str, outcome: str, seconds: float) -> None:
        with self.lock:
            self.rows.append((route, outcome, seconds))

    def post(self, client: httpx.Client, route: str, body: dict) -> dict | None:
        started = time.perf_counter()
        try:
            response = client.post(route, json=body)
            outcome = str(response.status_code)
        except httpx.HTTPError as error:
            self.add(route, type(error).__name__, time.perf_counter() - started)
            return None
        self.add(route, outcome, time.perf_counter() - started)
        return response.json() if response.status_code == 200 else None


class Editor:
    """One llama.vim user typing through a module, on slot `index`."""

    def __init__(self, index: int, seed: int):
        self.index, self.rng = index, random.Random(seed * 1000 + index)
        self.lines = module_lines(MODULES[index % len(MODULES)])
        self.line = min(PREFIX_LINES // 2 + 7 * index, len(self.lines) - 1)
        self.column = 0
        self.ring: list[dict] = []

    def refresh_ring(self) -> None:
        other = module_lines(MODULES[self.rng.randrange(len(MODULES))])
        start = self.rng.randrange(max(1, len(other) - CHUNK_LINES))
        self.ring = (self.ring + [{"filename": "other.py", "text": "".join(other[start : start + CHUNK_LINES])}])
        self.ring = self.ring[-RING_CHUNKS:]

    def advance(self) -> bool:
        """Type a few characters; True when the cursor moved to a new line."""
        self.column += self.rng.randint(1, 6)
        if self.column < len(self.lines[self.line].rstrip("\n")):
            return False
        self.line, self.column = (self.line + 1) % len(self.lines), 0
        return True

    def infill(self, n_predict: int) -> dict:
        text = self.lines[self.line]
        indent = len(text) - len(text.lstrip())
        return {"id_slot": self.index, "cache_prompt": True, "n_predict": n_predict, "n_indent": indent,
                "input_prefix": "".join(self.lines[max(0, self.line - PREFIX_LINES) : self.line]),
                "prompt": text[: self.column], "input_extra": self.ring,
                "input_suffix": text[self.column :] + "".join(self.lines[self.line + 1 : self.line + 1 + SUFFIX_LINES]),
                "t_max_predict_ms": 1000, "filename": f"{MODULES[self.index % len(MODULES)]}.py"}

    def chat(self) -> dict:
        code = "".join(self.lines[max(0, self.line - 12) : self.line])
        return {"messages": [{"role": "user", "content": f"What does this code do?\n\n{code}"}], "max_tokens": 48}

    def run(self, client: httpx.Client, log: Log, stop: threading.Event) -> None:
        self.refresh_ring()
        log.post(client, "/infill", self.infill(0))  # the file is opened: warm its slot
        while not stop.wait(self.rng.uniform(*THINK_SECONDS)):
            if self.rng.random() < CHAT_SHARE:
                log.post(client, "/v1/chat/completions", self.chat())
                continue
            if self.advance() and self.rng.random() < RING_SHARE:
                self.refresh_ring()
                log.post(client, "/infill", self.infill(0))
            log.post(client, "/infill", self.infill(self.rng.choice(N_PREDICT)))


def lsp_client(log: Log, stop: threading.Event, server: list[str], pid_box: list) -> None:
    """A language server client on its own event loop: one document, typed into, an inline completion every
    LSP_SECONDS."""
    from lsprotocol import types

    from .lsp_latency import Client

    async def main():
        client = Client()
        await client.start(server, {"debounce_ms": 0, "max_tokens": 32})
        pid_box.append(client.lsp._server.pid)
        lines = module_lines("textwrap")
        uri, line = "file:///soak/textwrap.py", 120
        client.open(uri, "".join(lines[:line]))
        while not stop.is_set():
            target = lines[line]
            client.insert(uri, line, 0, target)
            started = time.perf_counter()
            try:
                await client.lsp.text_document_inline_completion_async(types.InlineCompletionParams(
                    text_document=types.TextDocumentIdentifier(uri), position=types.Position(line + 1, 0),
                    context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic)))
                outcome = "200"
            except Exception as error:  # a JSON-RPC error or a dead server: counted, the soak goes on
                outcome = type(error).__name__
            log.add("lsp inlineCompletion", outcome, time.perf_counter() - started)
            line += 1
            await asyncio.sleep(LSP_SECONDS)
        await client.stop()

    asyncio.run(main())


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text: metric name -> value, labels summed."""
    values: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] += float(value)
    return values


def sample(client: httpx.Client, server: psutil.Process, lsp_pid: int | None, started: float) -> dict:
    row = {"t_s": round(time.monotonic() - started), "server_rss_mb": server.memory_info().rss >> 20}
    if lsp_pid is not None:
        try:
            row["lsp_rss_mb"] = psutil.Process(lsp_pid).memory_info().rss >> 20
        except psutil.Error:
            row["lsp_rss_mb"] = None
    slots = client.get("/slots").json()
    metrics = metric_values(client.get("/metrics").text)
    row.update(sessions=len(slots), kv_mb=round(sum(s["cache_bytes"] for s in slots) / 2**20, 1),
               busy_kv_mb=round(sum(s["cache_bytes"] for s in slots if s["busy"]) / 2**20, 1),
               queue=metrics.get("codespec_queue_depth"), active=metrics.get("codespec_active_generations"),
               pool_occupancy=metrics.get("codespec_pool_occupancy"))  # None while the server does not export it
    return row


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def route_summary(rows: list[tuple[str, str, float]]) -> dict:
    summary = {}
    for route in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == route]
        ok = [r[2] for r in mine if r[1] == "200"]
        summary[route] = {"requests": len(mine), "errors": dict(Counter(r[1] for r in mine if r[1] != "200")),
                          "p50_ms": round(1000 * statistics.median(ok)) if ok else None,
                          "p95_ms": round(1000 * percentile(ok, 0.95)) if ok else None}
    return summary


def memory_verdict(samples: list[dict], limit_mb: float) -> dict:
    """RSS growth over the second half of the run, in all and besides the KV caches (which grow with the editors'
    prefixes up to --session-memory; what else the server holds must level off), and the KV cache against
    --session-memory: over it only while the busy sessions alone are over it."""
    half = samples[len(samples) // 2 :]
    other = [s["server_rss_mb"] - s["kv_mb"] for s in half]
    over = [s for s in samples if s["kv_mb"] > limit_mb]
    return {"rss_first_mb": samples[0]["server_rss_mb"], "rss_max_mb": max(s["server_rss_mb"] for s in samples),
            "rss_last_mb": samples[-1]["server_rss_mb"],
            "rss_growth_second_half_mb": half[-1]["server_rss_mb"] - half[0]["server_rss_mb"],
            "other_growth_second_half_mb": round(other[-1] - other[0]),
            "other_range_second_half_mb": round(max(other) - min(other)),
            "kv_max_mb": max(s["kv_mb"] for s in samples), "session_memory_mb": limit_mb,
            "samples_over_session_memory": len(over),
            "over_with_idle_sessions_to_evict": sum(s["busy_kv_mb"] <= limit_mb for s in over)}


def table(result: dict) -> str:
    config = result["config"]
    out = [f"codespec soak: {config['editors']} editors, {config['seconds']} s (the last sample after the traffic "
           f"stopped), --session-memory "
           f"{config['session_memory_mb']} MB, malloc {config['malloc']}, {config['device']}", "",
           f"{'route':<22}{'requests':>9}{'p50 ms':>9}{'p95 ms':>9}  errors"]
    for route, row in result["routes"].items():
        errors = ", ".join(f"{k}: {v}" for k, v in row["errors"].items()) or "none"
        out.append(f"{route:<22}{row['requests']:>9}{row['p50_ms'] or '-':>9}{row['p95_ms'] or '-':>9}  {errors}")
    out += ["", f"{'t s':>6}{'RSS MB':>8}{'- KV MB':>8}{'lsp MB':>8}{'sessions':>9}{'KV MB':>8}{'busy KV':>8}"
                f"{'queue':>6}{'active':>7}{'pool':>6}"]
    for s in result["samples"]:
        pool = "-" if s.get("pool_occupancy") is None else f"{s['pool_occupancy']:.1%}"
        out.append(f"{s['t_s']:>6}{s['server_rss_mb']:>8}{s['server_rss_mb'] - s['kv_mb']:>8.0f}"
                   f"{s.get('lsp_rss_mb') or '-':>8}{s['sessions']:>9}"
                   f"{s['kv_mb']:>8}{s['busy_kv_mb']:>8}{s['queue'] or 0:>6.0f}{s['active'] or 0:>7.0f}{pool:>6}")
    memory = result["memory"]
    out += ["", f"server RSS: {memory['rss_first_mb']} MB at the first sample, {memory['rss_max_mb']} MB at most, "
                f"{memory['rss_growth_second_half_mb']:+} MB over the second half; besides the KV caches "
                f"{memory['other_growth_second_half_mb']:+} MB over the second half (range "
                f"{memory['other_range_second_half_mb']} MB)",
            f"KV cache: {memory['kv_max_mb']} MB at most against --session-memory {memory['session_memory_mb']} MB; "
            f"over it in {memory['samples_over_session_memory']} samples, "
            f"{memory['over_with_idle_sessions_to_evict']} of them with idle sessions that could have gone"]
    return "\n".join(out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codespec.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--editors", type=int, default=16, help="simulated llama.vim editors (default 16)")
    parser.add_argument("--minutes", type=float, default=10, help="how long the traffic runs (default 10)")
    parser.add_argument("--sample-seconds", type=float, default=30, help="RSS, /slots and /metrics (default 30)")
    parser.add_argument("--session-memory", type=int, default=SESSION_MEMORY >> 20, metavar="MB",
                        help=f"the server's --session-memory (default {SESSION_MEMORY >> 20})")
    parser.add_argument("--malloc", choices=("fixed", "glibc"), default="fixed",
                        help="fixed: codespec/cli/memory.py's mmap threshold (default); glibc: glibc's dynamic one")
    parser.add_argument("--no-lsp", action="store_true", help="leave the language server out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-arg", action="append", default=[], help="one more `codespec serve` argument")
    parser.add_argument("--out", default="docs/benchmarks/soak", help="folder for soak-*.json and .txt")
    args = parser.parse_args(argv)

    env = {**os.environ, "CODESPEC_API_KEY": ""}
    if args.malloc == "glibc":
        env["CODESPEC_MMAP_THRESHOLD"] = "0"
    port = free_port()
    command = [sys.executable, "-m", "codespec", "serve", "--port", str(port), "--session-memory",
               str(args.session_memory), *args.server_arg]
    server = subprocess.Popen(command, env=env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    log, stop, lsp_pid = Log(), threading.Event(), []
    threads = []
    try:
        wait_until_healthy(server, client)
        model = client.get("/v1/models").json()["data"][0]["id"]
        started = time.monotonic()
        for index in range(args.editors):
            editor = Editor(index, args.seed)
            own = httpx.Client(base_url=client.base_url, timeout=300)
            threads.append(threading.Thread(target=editor.run, args=(own, log, stop), daemon=True))
        if not args.no_lsp:
            lsp_server = [sys.executable, "-m", "codespec", "lsp"]
            threads.append(threading.Thread(target=lsp_client, args=(log, stop, lsp_server, lsp_pid), daemon=True))
        for thread in threads:
            thread.start()
        process, samples = psutil.Process(server.pid), []
        end = started + 60 * args.minutes
        while True:
            now = time.monotonic()
            if now >= end:
                break
            time.sleep(min(args.sample_seconds, end - now))
            samples.append(sample(client, process, lsp_pid[0] if lsp_pid else None, started))
            print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
        stop.set()
        for thread in threads:  # requests under way finish, and are counted
            thread.join(timeout=300)
        seconds = round(time.monotonic() - started)
        samples.append(sample(client, process, lsp_pid[0] if lsp_pid else None, started))
    finally:
        stop.set()
        client.close()
        server.terminate()
        server.wait(timeout=60)

    result = {"config": {"editors": args.editors, "seconds": seconds, "session_memory_mb": args.session_memory,
                         "malloc": args.malloc, "lsp": not args.no_lsp, "seed": args.seed, "model": model,
                         "device": f"{os.cpu_count()} CPU cores", "server_args": args.server_arg},
              "routes": route_summary(log.rows), "samples": samples,
              "memory": memory_verdict(samples, args.session_memory)}
    text = table(result)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"soak-{args.editors}x{round(args.minutes * 60)}s-{args.malloc}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
