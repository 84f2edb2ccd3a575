"""`codespec` pull | generate | ngram-cache build | lsp | serve (bench: codespec/bench/command.py), and `main`,
which turns every error into one line and an exit status."""

from __future__ import annotations

import json
import os
import sys

from ..config import DEFAULT_MODEL, ModelConfig
from ..errors import CodespecError
from .memory import lifelong_heap, return_freed_memory
from .options import MODEL_FLAGS, build_parser, served_names, server_config, settings_from_args


def read_prompt(args) -> str:
    if args.prompt is not None and args.file:
        raise CodespecError("give the prompt as an argument or with --file, not both")
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as handle:
                prompt = handle.read()
        except OSError as exc:
            raise CodespecError(f"cannot read {args.file}: {exc.strerror}") from None
    elif args.prompt is not None:
        prompt = args.prompt
    elif not sys.stdin.isatty():
        prompt = sys.stdin.read()
    else:
        raise CodespecError("no prompt: pass it as an argument, with --file, or on standard input")
    if not prompt.strip():
        raise CodespecError("the prompt is empty")
    return prompt


def run_generate(args) -> int:
    prompt = read_prompt(args)
    model_config, spec, params = settings_from_args(args)
    with lifelong_heap():
        from ..engine import Engine

        engine = Engine.load(model_config, spec, show_progress=sys.stderr.isatty())
    if sys.stderr.isatty():  # what runs (the forward, weights, cache, kernels), beside the progress bars
        print(f"codespec: {engine.plan}", file=sys.stderr, flush=True)
    prompt_ids = engine.encode(prompt, chat=args.chat, system=args.system)
    result = None
    for chunk in engine.stream(prompt_ids, params):
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        result = chunk.result or result
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        sys.stdout.write("\n")
        print(result.stats.summary(), file=sys.stderr)
        for drafter in result.stats.drafters:
            print("  " + drafter.summary(), file=sys.stderr)
    return 0


def run_ngram_cache(args) -> int:
    from transformers import AutoTokenizer

    from ..drafters.ngram_cache import build_static_cache, save_static_cache
    from ..forward.models import model_source, pull

    kind, _ = model_source(args.model or DEFAULT_MODEL)
    location = str(pull(args.model or DEFAULT_MODEL, show_progress=sys.stderr.isatty()))
    tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=kind != "hub")
    sequences = []
    for path in args.files:
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                sequences.append(tokenizer(handle.read(), add_special_tokens=False).input_ids)
        except OSError as exc:
            raise CodespecError(f"cannot read {path}: {exc.strerror}") from None
    cache = build_static_cache(sequences, max_n=args.n_max)
    try:
        save_static_cache(cache, args.output)
    except OSError as exc:
        raise CodespecError(f"cannot write {args.output}: {exc.strerror}") from None
    tokens = sum(len(s) for s in sequences)
    print(f"{args.output}: {len(cache.counts)} n-grams from {tokens} tokens in {len(sequences)} files",
          file=sys.stderr)
    return 0


def run_lsp(args) -> int:
    from lsp.server import serve

    return_freed_memory()  # a long-running process: freed buffers go back to the system (memory.py)

    tcp = None
    if args.tcp is not None:
        host, _, port = args.tcp.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise CodespecError(f"--tcp wants HOST:PORT, got {args.tcp!r}")
        tcp = (host, int(port))
    given = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name) is not None}
    model_config = ModelConfig(**given)
    server_url = None
    if args.server is not None:
        server_url = args.server if "://" in args.server else f"http://{args.server}"
        if not server_url.startswith(("http://", "https://")):
            raise CodespecError(f"--server wants an http:// or https:// URL, got {args.server!r}")
        if given:
            raise CodespecError("--server generates on that server's model: leave out --model, --device, --dtype, "
                                "--forward, --weights, --prompt-precision, --cache-type and --activations")
    serve(model_config, model_fixed=args.model is not None, tcp=tcp, server_url=server_url,
          api_key=args.api_key or None, cache_reuse=args.cache_reuse)
    return 0


def apply_threads(threads: int | None) -> None:
    """-t/--threads: PyTorch's threads, which numba's pool follows on the engine's worker
    (forward/kernels/attention.match_threads), and numba's on this thread."""
    if threads is None:
        return
    import numba
    import torch

    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def run_serve(args) -> int:
    if args.replicas and args.threads is not None:
        raise CodespecError("-t/--threads sets this process's threads; with --replicas, --replica-cpus sets each "
                            "replica's")
    if args.replicas:
        try:
            from ..replicas.deploy import run_replicas
        except ImportError as exc:
            raise CodespecError(f"--replicas needs Ray Serve: pip install 'codespec[replicas]' ({exc})") from None
        return run_replicas(args)
    return_freed_memory()  # a long-running process: freed buffers go back to the system (memory.py)

    model_config, spec, params = settings_from_args(args)
    config = server_config(args)
    with lifelong_heap():
        import uvicorn

        from ..engine import Engine
        from ..server import create_app, uvicorn_options

        apply_threads(args.threads)
        engine = Engine.load(model_config, spec, show_progress=sys.stderr.isatty())
        engine.cache_reuse = args.cache_reuse
        name, aliases = served_names(model_config.model, args.alias)  # (smollm2, default: the embedded model's)
        app = create_app(engine, config, params, spec, model_name=name, model_aliases=aliases)
    print(f"codespec: {engine.plan}", file=sys.stderr, flush=True)
    print(f"codespec: serving {name} on http://{config.host}:{config.port} (/infill, /v1/completions, "
          f"/v1/chat/completions, /metrics, /slots)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning", **uvicorn_options(config))
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        raise CodespecError(f"cannot serve on {config.host}:{config.port} (is the port in use?)") from exc
    return 0


def run_bench(args) -> int:
    from ..bench.command import run

    return run(args)


def run_pull(args) -> int:
    from ..forward.models import pull

    path = pull(args.model)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        commands = {"pull": run_pull, "generate": run_generate, "bench": run_bench, "ngram-cache": run_ngram_cache,
                    "lsp": run_lsp, "serve": run_serve}
        return commands[args.command](args)
    except CodespecError as exc:
        print(f"codespec: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("codespec: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, not bad input: still one line unless asked for the traceback
        if os.environ.get("CODESPEC_DEBUG"):
            raise
        print(f"codespec: internal error: {type(exc).__name__}: {exc} (set CODESPEC_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 70


def quiet_libraries() -> None:
    """transformers' own progress bars and warnings would bury our one-line messages. Said through the environment,
    which transformers and huggingface_hub read when imported (importing them here took ~1 s of every start, and a
    GGUF read directly never imports them), and to them directly where a caller imported them already."""
    for name, value in (("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error"),
                        ("HF_HUB_VERBOSITY", "error"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
        os.environ.setdefault(name, value)
    if "transformers" in sys.modules:  # (imported already, by a caller of `main`: told directly)
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()
