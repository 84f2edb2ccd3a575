"""The `codespec` parser, and the settings a command builds from parsed arguments: ModelConfig, SpecConfig and
SamplingParams (defaults, then a --config file, then the flags), and `codespec serve`'s ServerConfig. Light (no
torch): the Ray Serve deployment (replicas/deploy.py) builds its replicas' settings from the same functions."""

from __future__ import annotations

import argparse
import os

from ..bench.command import add_arguments as add_bench_arguments
from ..config import DEFAULT_MODEL, SPEC_CHOICES, ModelConfig, SamplingParams, ServerConfig, SpecConfig
from ..errors import CodespecError
from .types import (MODEL_FLAGS, OneLineParser, add_model_options, add_spec_options, bounded_int, llama_spec_list,
                    name_list, spec_list)

__all__ = ["MODEL_FLAGS", "build_parser", "served_names", "server_config", "settings_from_args"]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="codespec", description="Lossless self-speculative decoding for coding assistants.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    pull = commands.add_parser("pull", help="prepare a model (the embedded default unless --model)")
    pull.add_argument("--model", default=DEFAULT_MODEL)
    add_generate(commands)
    add_ngram_cache(commands)
    add_lsp(commands)
    serve = add_serve(commands)
    add_replicas(serve)
    bench = commands.add_parser("bench", help="measure speculation against plain decoding and transformers")
    add_model_options(bench)
    add_bench_arguments(bench)
    return parser


def add_generate(commands) -> None:
    gen = commands.add_parser("generate", help="generate text with speculative decoding")
    gen.add_argument("prompt", nargs="?", help="the prompt (else --file, else standard input)")
    gen.add_argument("--file", help="read the prompt from this file")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", help="system message for --chat")
    add_model_options(gen)
    sampling = SamplingParams()
    gen.add_argument("--spec", type=spec_list, default=None,
                     help=f"comma-separated drafter chain from: {', '.join(SPEC_CHOICES)} "
                          f"(default {','.join(SpecConfig().spec)})")
    add_spec_options(gen)
    gen.add_argument("--config", help="TOML file with [model], [spec] and [sampling] tables (flags override it)")
    gen.add_argument("--max-tokens", type=bounded_int(1, 1 << 20), help=f"(default {sampling.max_tokens})")
    gen.add_argument("--temperature", type=float, help="(default 0: greedy)")
    gen.add_argument("--top-k", type=int, help="(default 0: off)")
    gen.add_argument("--top-p", type=float, help="(default 1.0: off)")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, tokens and stats")


def add_ngram_cache(commands) -> None:
    cache = commands.add_parser("ngram-cache", help="static n-gram caches for the ngram-cache drafter")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True, parser_class=OneLineParser)
    build = cache_commands.add_parser("build", help="count the n-grams of FILES into a static cache file")
    build.add_argument("files", nargs="+", metavar="FILE")
    build.add_argument("-o", "--output", required=True, help="the cache file to write (.npz)")
    build.add_argument("--model", help="whose tokenizer to count with (default: the embedded model)")
    build.add_argument("--n-max", type=bounded_int(1, 8), default=SpecConfig().cache_n_max)


def add_lsp(commands) -> None:
    lsp = commands.add_parser("lsp", help="the language server: inline completions and refactoring commands "
                                          "(stdio unless --tcp)")
    add_model_options(lsp)
    lsp.add_argument("--tcp", metavar="HOST:PORT", help="listen on a TCP port for one client instead of stdio")
    lsp.add_argument("--cache-reuse", type=bounded_int(0, 1 << 20), default=0, metavar="N",
                     help="as `codespec serve --cache-reuse`: reuse cached chunks of at least N tokens at new positions "
                          "(default 0: off)")
    lsp.add_argument("--server", metavar="URL",
                     help="generate on this codespec HTTP server (`codespec serve`) instead of loading a model: "
                          "documents, context and commands stay here, completions go to its /infill")
    lsp.add_argument("--api-key", default=os.environ.get("CODESPEC_API_KEY"),
                     help="the --server's API key (default: $CODESPEC_API_KEY; the editor's api_key setting "
                          "replaces it)")


def add_serve(commands) -> argparse.ArgumentParser:
    """`codespec serve`: the HTTP server's own options, then the model's, the drafters' and the engine's; where
    llama-server has a flag for the same setting, its spelling too (-m, -md, -ctk/-ctv, -t, --alias, --spec-type,
    -c, -n), so a llama-server command line starts codespec."""
    serve = commands.add_parser("serve", help="HTTP server: llama.cpp-compatible /infill, OpenAI completions "
                                              "and chat, /metrics, /slots")
    server = ServerConfig()
    serve.add_argument("--host", default=server.host, help=f"(default {server.host}: this machine only)")
    serve.add_argument("--port", type=bounded_int(0, 65535), default=server.port, help=f"(default {server.port})")
    serve.add_argument("--api-key", default=os.environ.get("CODESPEC_API_KEY"),
                       help="require 'Authorization: Bearer KEY' or 'X-Api-Key: KEY' (default: $CODESPEC_API_KEY, "
                            "else none); several keys comma-separated: each key's clients get their own sessions "
                            "and caches")
    serve.add_argument("--allowed-hosts", type=name_list, default=(), metavar="NAMES",
                       help="Host names to serve besides localhost, IP addresses and --host, comma-separated "
                            "('*.lan': any name under lan, '*': any); others get 403 (DNS rebinding)")
    serve.add_argument("--allowed-origins", type=name_list, default=(), metavar="ORIGINS",
                       help="web origins whose pages may call the server (CORS), comma-separated, e.g. "
                            "https://editor.example ('*': any); other pages' requests get 403")
    serve.add_argument("--read-timeout", type=float, default=server.read_timeout, metavar="SECONDS",
                       help=f"seconds a client may take to send its request headers, then its body "
                            f"(default {server.read_timeout:g})")
    serve.add_argument("--alias", type=name_list, default=(), metavar="NAME",
                       help="the model name every answer reports and /v1/models lists (llama-server's --alias; "
                            "default: the model's); more names comma-separated are accepted in requests' `model`, as "
                            "is the model's own name")
    serve.add_argument("-t", "--threads", type=bounded_int(1, 4096), default=None, metavar="N",
                       help="CPU threads for PyTorch and numba (llama-server's -t; default: PyTorch's, one per core)")
    add_model_options(serve, llama_server=True)
    serve.add_argument("--spec", "--spec-type", type=llama_spec_list, default=None,
                       help=f"default drafter chain (default {','.join(SpecConfig().spec)}); requests may override; "
                            "--spec-type takes llama-server's names too (ngram-simple: prompt-lookup, draft-simple: "
                            "draft)")
    add_spec_options(serve, llama_server=True)
    serve.add_argument("--config", help="TOML file with [model], [spec] and [sampling] tables (flags override it)")
    serve.add_argument("--max-queue", type=bounded_int(1, 1 << 16), default=server.max_queue,
                       help=f"requests waiting before 429 (default {server.max_queue})")
    serve.add_argument("--parallel", type=bounded_int(1, 1024), default=server.parallel,
                       help=f"requests taking turns step by step (default {server.parallel})")
    serve.add_argument("--slots", type=bounded_int(0, 1024), default=server.slots,
                       help=f"sessions picked by longest common prefix for requests naming none (default {server.slots})")
    serve.add_argument("--session-memory", type=bounded_int(0, 1 << 20), default=server.session_memory >> 20,
                       metavar="MB", help=f"KV-cache MB named sessions may hold before the least recently used are "
                                          f"evicted (default {server.session_memory >> 20})")
    serve.add_argument("--cache-reuse", type=bounded_int(0, 1 << 20), default=0, metavar="N",
                       help="reuse cached chunks of at least N tokens that a new prompt holds at other positions "
                            "(llama-server's --cache-reuse; llama.vim's sliding window): much less prefill, output "
                            "close to but not always identical to a cold prefill (default 0: off)")
    serve.add_argument("-n", "--n-predict", type=int, default=None, metavar="N",
                       help="most tokens a request generates: those that set no n_predict/max_tokens get N, those "
                            "asking for more are cut to N (llama-server's -n; default: a [sampling] max_tokens in "
                            "--config, else -1: until the end of the text or of the context)")
    return serve


def add_replicas(serve) -> None:
    """`codespec serve --replicas N`: the same server as N engines on Ray Serve, and where they run."""
    serve.add_argument("--replicas", type=bounded_int(0, 1024), default=0, metavar="N",
                       help="run N engines on Ray Serve behind this one address, routed by session "
                            "(pip install 'codespec[replicas]'; default 0: one engine in this process)")
    serve.add_argument("--replica-cpus", type=float, default=1.0, metavar="CPUS",
                       help="CPUs (and torch threads) each replica reserves (default 1)")
    serve.add_argument("--replica-gpus", type=float, default=0.0, metavar="GPUS",
                       help="GPUs each replica reserves (default 0)")
    serve.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS"), metavar="ADDRESS",
                       help="the Ray cluster for --replicas ('auto', ray://HOST:10001; default $RAY_ADDRESS, else "
                            "a local Ray started and stopped with this command)")


def served_names(model: str, alias: tuple[str, ...] = ()) -> tuple[str, tuple[str, ...]]:
    """The name every answer reports and the other names a request's `model` may give: --alias's first name, else
    the model's (the embedded model's own name for its aliases); the model's names stay accepted."""
    from ..forward.models import DEFAULT_ALIASES, DEFAULT_NAME

    name = DEFAULT_NAME if model in DEFAULT_ALIASES else model
    accepted = set(DEFAULT_ALIASES) if model in DEFAULT_ALIASES else set()
    if alias:
        accepted |= {name, *alias[1:]}
        name = alias[0]
    return name, tuple(sorted(accepted - {name}))


def settings_from_args(args) -> tuple[ModelConfig, SpecConfig, SamplingParams]:
    """Defaults (codespec/config.py), then the --config file, then the flags given."""
    from dataclasses import fields

    from ..config import load_toml

    try:
        loaded = load_toml(args.config) if getattr(args, "config", None) else {}
    except ValueError as exc:
        raise CodespecError(str(exc)) from None
    built = []
    for name, cls in (("model", ModelConfig), ("spec", SpecConfig), ("sampling", SamplingParams)):
        values = dict(loaded.get(name, {}))
        for field in fields(cls):
            given = getattr(args, field.name, None)
            if given is not None:
                values[field.name] = tuple(given) if isinstance(given, list) else given
        built.append(cls(**values))  # (each checks itself)
    return tuple(built)


def server_config(args) -> ServerConfig:
    """`codespec serve`'s ServerConfig from its arguments, checked (a bad value stops the start with one line)."""
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key or None, max_queue=args.max_queue,
                          parallel=args.parallel, slots=args.slots, session_memory=args.session_memory << 20,
                          allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                          read_timeout=args.read_timeout, n_predict=serve_n_predict(args))
    return config


def serve_n_predict(args) -> int:
    """--n-predict, else the --config file's [sampling] max_tokens (the server's default length before there was
    --n-predict), else -1."""
    if args.n_predict is not None:
        return args.n_predict
    from ..config import load_toml

    loaded = load_toml(args.config) if args.config else {}  # read (and checked) by settings_from_args already
    return loaded.get("sampling", {}).get("max_tokens", ServerConfig.n_predict)
