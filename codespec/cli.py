"""codespec command line: pull | generate | bench | ngram-cache build | lsp | serve."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import (ACTIVATIONS_CHOICES, CACHE_TYPES, DEFAULT_MODEL, DRAFT_MAX_LIMIT, FORWARD_CHOICES, INVARIANT_CHOICES,
                     PROMPT_PRECISION_CHOICES, SPEC_CHOICES, WEIGHTS_CHOICES, ModelConfig, SamplingParams, ServerConfig,
                     SpecConfig, unknown_drafters)
from .errors import CodespecError


class OneLineParser(argparse.ArgumentParser):
    """argparse, but usage mistakes print one line and exit 2."""

    def error(self, message: str):
        self.exit(2, f"codespec: error: {message}\n")


def spec_list(value: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    problem = unknown_drafters(names)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return names


def name_list(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


def bounded_int(low: int, high: int):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{number} is outside {low}..{high}")
        return number
    return parse


# add_model_options' flags: ModelConfig's fields
MODEL_FLAGS = ("model", "device", "dtype", "forward", "weights", "prompt_precision", "cache_type", "activations",
               "invariant", "context")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=f"{DEFAULT_MODEL} (default, embedded), a transformers directory, "
                                        "a .gguf file, or a hub id")
    parser.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", help="auto (default: float32 on cpu, and on cuda for models up to 1.5B "
                        "parameters, else bfloat16), float32, bfloat16, float16")
    parser.add_argument("--forward", choices=FORWARD_CHOICES,
                        help="lean (default: own Llama forward, static KV cache; graph-safe on GPUs), graphs (the "
                             "graph-safe forward anywhere) or transformers")
    parser.add_argument("--ctx-size", "-c", dest="context", type=int,
                        help="tokens of context, prompt plus output (default 0: the model's own, 8,192 for the "
                             "default model); on GPUs each session's cache has this fixed size")
    parser.add_argument("--weights", choices=WEIGHTS_CHOICES,
                        help="auto (default: gguf where it runs, else checkpoint), checkpoint (the converted model, "
                             "bfloat16 values in float32) or gguf (the GGUF's own Q4_1/Q8_0 blocks, as llama-server "
                             "reads them: CPU, float32, lean forward)")
    parser.add_argument("--prompt-precision", choices=PROMPT_PRECISION_CHOICES,
                        help="how prompt chunks of more than 16 tokens are multiplied on a CPU in float32: auto "
                             "(default: bfloat16 where it measures faster), float32, or bfloat16 (inputs and weights "
                             "rounded to bfloat16, float32 sums); generated tokens always use float32")
    parser.add_argument("--cache-type", choices=CACHE_TYPES,
                        help="the KV cache's element type: auto (default: f16 where it runs, else f32), f32 (the "
                             "model's dtype), f16 (llama.cpp's default: half the memory and of what attention "
                             "reads; CPU, float32, lean forward) or q8 (8-bit integers and a scale per key and value, "
                             "as llama.cpp's q8_0: 53%% of f16's bytes; with --activations q8)")
    parser.add_argument("--invariant", choices=INVARIANT_CHOICES,
                        help="on (default): every CPU forward in per-row kernels, prompts included, so the text does "
                             "not depend on how a prompt was chunked, batched with other sessions or cached (prefill "
                             "about 2x slower on AVX2 CPUs); off: long prompt chunks in faster GEMMs whose bits "
                             "depend on the chunk")
    parser.add_argument("--activations", choices=ACTIVATIONS_CHOICES,
                        help="what a GGUF's blocks multiply: auto (default: q8 where the CPU has AVX512-VNNI), q8 "
                             "(inputs rounded to 8 bits per 32 and exact integer sums, as llama.cpp multiplies them) "
                             "or float32")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="codespec", description="Lossless self-speculative decoding for coding assistants.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    pull = commands.add_parser("pull", help="prepare a model (the embedded default unless --model)")
    pull.add_argument("--model", default=DEFAULT_MODEL)

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
    cache = commands.add_parser("ngram-cache", help="static n-gram caches for the ngram-cache drafter")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True, parser_class=OneLineParser)
    build = cache_commands.add_parser("build", help="count the n-grams of FILES into a static cache file")
    build.add_argument("files", nargs="+", metavar="FILE")
    build.add_argument("-o", "--output", required=True, help="the cache file to write (.npz)")
    build.add_argument("--model", help="whose tokenizer to count with (default: the embedded model)")
    build.add_argument("--n-max", type=bounded_int(1, 8), default=SpecConfig().cache_n_max)

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

    serve = commands.add_parser("serve", help="HTTP server: llama.cpp-compatible /infill, OpenAI completions "
                                              "and chat, /metrics, /slots")
    server = ServerConfig()
    serve.add_argument("--host", default=server.host, help=f"(default {server.host}: this machine only)")
    serve.add_argument("--port", type=bounded_int(0, 65535), default=server.port, help=f"(default {server.port})")
    serve.add_argument("--api-key", default=os.environ.get("CODESPEC_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $CODESPEC_API_KEY, else none); several "
                            "keys comma-separated: each key's clients get their own sessions and caches")
    serve.add_argument("--allowed-hosts", type=name_list, default=(), metavar="NAMES",
                       help="Host names to serve besides localhost, IP addresses and --host, comma-separated "
                            "('*.lan': any name under lan, '*': any); others get 403 (DNS rebinding)")
    serve.add_argument("--allowed-origins", type=name_list, default=(), metavar="ORIGINS",
                       help="web origins whose pages may call the server (CORS), comma-separated, e.g. "
                            "https://editor.example ('*': any); other pages' requests get 403")
    serve.add_argument("--read-timeout", type=float, default=server.read_timeout, metavar="SECONDS",
                       help=f"seconds a client may take to send its request headers, then its body "
                            f"(default {server.read_timeout:g})")
    add_model_options(serve)
    serve.add_argument("--spec", type=spec_list, default=None,
                       help=f"default drafter chain (default {','.join(SpecConfig().spec)}); requests may override")
    add_spec_options(serve)
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
    serve.add_argument("-n", "--n-predict", type=int, default=None, metavar="N",
                       help="most tokens a request generates: those that set no n_predict/max_tokens get N, those "
                            "asking for more are cut to N (llama-server's -n; default: a [sampling] max_tokens in "
                            "--config, else -1: until the end of the text or of the context)")

    bench = commands.add_parser("bench", help="measure speculation against plain decoding and transformers")
    add_model_options(bench)
    bench.add_argument("--quick", action="store_true",
                       help="one workload per class, 3 turns, 48 tokens, 4 configurations, once (< 3 min on 2 cores)")
    bench.add_argument("--per-class", type=bounded_int(1, 5), default=2, help="workloads per class")
    bench.add_argument("--classes", default="edit,completion,multi-turn,free-form,prose",
                       help="comma-separated workload classes to run")
    bench.add_argument("--configs", help="comma-separated configurations to run (default: all; plain and "
                                         "'transformers prompt lookup' always run, as the baselines)")
    bench.add_argument("--repeats", type=bounded_int(1, 50), default=3, help="runs per configuration (median)")
    bench.add_argument("--max-tokens", type=bounded_int(1, 4096), default=256, help="new tokens per turn")
    bench.add_argument("--draft-max", type=bounded_int(1, DRAFT_MAX_LIMIT), default=SpecConfig().draft_max)
    bench.add_argument("--never-slower", action="store_true",
                       help="the never-slower lane: every drafter and the default chain against plain at each of "
                            "--lengths, --repeats paired interleaved rounds, spread reported, anything under 0.97x "
                            "named (writes never-slower.json)")
    bench.add_argument("--lengths", default="32,128,512", metavar="N,N",
                       help="tokens per generation in the never-slower lane (default 32,128,512)")
    bench.add_argument("--two-session", action="store_true",
                       help="session A rewrites a file, then session B rewrites it: the shared pool at work")
    bench.add_argument("--forward-costs", action="store_true",
                       help="only time one forward over k = 1..64 tokens per forward path, next to the machine's "
                            "floor, with a profile (a full run includes this)")
    bench.add_argument("--no-forward-costs", action="store_true",
                       help="leave the forward-cost table out of a full run (saves about two minutes)")
    bench.add_argument("--out", default="bench-results", help="folder for bench.json and bench.png")
    bench.add_argument("--llama-server", metavar="PATH",
                       help="also run llama.cpp's llama-server (this binary) on the same GGUF and prompts, side by "
                            "side: plain, and its n-gram speculation at its defaults and at draft-max 16 (build one "
                            "with python -m codespec.bench.build_llama_server --out DIR)")
    bench.add_argument("--llama-server-threads", type=bounded_int(1, 1024), metavar="N",
                       help="llama-server's -t/-tb (default: torch's thread count, codespec's own)")
    bench.add_argument("--llama-server-spec-types", default="ngram-simple,ngram-mod", metavar="TYPES",
                       help="llama-server's n-gram --spec-type values to run (default ngram-simple,ngram-mod; also "
                            "ngram-map-k, ngram-map-k4v, ngram-cache)")
    return parser


def run_bench(args) -> int:
    import contextlib
    from pathlib import Path

    from tqdm.auto import tqdm

    from .bench import runner
    from .bench.workloads import all_workloads
    from .engine import Engine

    quick = args.quick
    repeats, max_tokens, turns = (1, 48, 3) if quick else (args.repeats, args.max_tokens, 5)
    classes = {name.strip() for name in args.classes.split(",") if name.strip()}
    try:
        lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1 or max(lengths) > 4096:
        raise CodespecError(f"--lengths takes token counts from 1 to 4096, like 32,128,512; got {args.lengths!r}")
    workloads = [w for w in all_workloads(1 if quick else args.per_class) if w.kind in classes]
    known = [c.name for c in runner.build_configs(quick, args.draft_max, SpecConfig())]
    wanted = set(known)
    if args.configs:
        wanted = {name.strip() for name in args.configs.split(",")} | {runner.PLAIN, runner.HF_LOOKUP}
        unknown = wanted - set(known)
        if unknown:
            raise CodespecError(f"unknown bench config {', '.join(sorted(unknown))}; choose from {', '.join(known)}")
    if not workloads:
        raise CodespecError(f"no workload in classes {args.classes!r}; use edit, completion, multi-turn, free-form, prose")
    peer = None
    if args.llama_server:  # checked before the model loads, so a wrong path is a one-line error at once
        import torch

        from .bench.llama_server import Peer, check_binary, gguf_for

        check_binary(args.llama_server)  # before the GGUF is looked for
        peer = Peer(args.llama_server, gguf_for(args.model),
                    args.llama_server_threads or torch.get_num_threads(),
                    [t.strip() for t in args.llama_server_spec_types.split(",") if t.strip()])
    engine = Engine.load(ModelConfig(**{name: getattr(args, name) for name in MODEL_FLAGS
                                        if getattr(args, name) is not None}))
    configs = [c for c in runner.build_configs(quick, args.draft_max, SpecConfig(draft_max=args.draft_max),
                                               engine.model.config.num_hidden_layers) if c.name in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.two_session:
        from .bench.two_session import CONFIGS, format_rows, run_two_session

        with tqdm(total=2 * len(CONFIGS), desc="two-session", unit="run") as progress:
            rows = run_two_session(engine, args.max_tokens, progress=progress)
        print(format_rows(rows))
        (out / "two-session.json").write_text(json.dumps({"two_session": rows, "max_tokens": args.max_tokens},
                                                         indent=2))
        return 0
    if args.never_slower:
        from .bench.never_slower import format_lane, rounds, run_lane

        lane = [c for c in configs if c.spec is not None and c.name != runner.FIXED_CHAIN]  # plain among them
        runs = len(workloads) * (len(lane) + 1) * sum(rounds(repeats, n) for n in lengths)
        with tqdm(total=runs, desc="never slower", unit="run") as bar:
            data = run_lane(engine, workloads, lane, lengths, repeats, progress=bar)
        print(format_lane(data))
        (out / "never-slower.json").write_text(json.dumps(data, indent=2))
        return 0
    forward = None
    if args.forward_costs and engine.model.device.type == "cuda":  # a GPU's floors and forwards (bench/cuda.py)
        from .bench.cuda import forward_section, format_forward

        forward = forward_section(engine.model)
        print(format_forward(forward))
        (out / "forward.json").write_text(json.dumps(forward, indent=2))
        return 0
    if args.forward_costs or not (quick or args.no_forward_costs):
        from .bench.forward_costs import forward_costs, format_forward_costs, outside_forward_share

        from .models import gguf_source

        try:
            source = engine.gguf or gguf_source(args.model or DEFAULT_MODEL)
        except CodespecError:  # no GGUF behind this model: no row for its blocks
            source = None
        base = engine.model
        if engine.gguf is not None:  # its weights are the GGUF's values now: the other rows need the checkpoint's
            from .models import load

            base, _ = load(ModelConfig(**{name: getattr(args, name) for name in ("model", "device", "dtype")
                                          if getattr(args, name) is not None}), show_progress=False)
        from . import q8

        with tqdm(total=(6 + q8.available() if source else 5), desc="forward costs", unit="step") as progress:
            forward = forward_costs(base, base.config.vocab_size, progress, gguf=source)
            edits = [w for w in all_workloads(1) if w.kind == "edit"]
            forward["outside_forwards_at_draft_max_64"] = outside_forward_share(engine, edits[0], max_tokens)
            progress.update()
        print(format_forward_costs(forward))
        if args.forward_costs:
            (out / "forward.json").write_text(json.dumps(forward, indent=2))
            return 0
    settings = {"device": engine.model.device, "dtype": str(engine.model.dtype).removeprefix("torch."),
                "weights": "gguf" if engine.gguf else "checkpoint",
                "max_tokens": max_tokens, "repeats": repeats, "turns": turns, "quick": quick}
    with peer if peer is not None else contextlib.nullcontext():  # llama-server processes stop on the way out
        if peer is not None:
            configs += [runner.Config(name, server=server) for name, server in peer.servers.items()]
            settings["llama_server"] = peer.describe()
        with tqdm(total=len(workloads) * len(configs) * repeats, desc="bench", unit="run") as progress:
            rows = runner.run_bench(engine, workloads, configs, repeats, max_tokens, turns, progress)
    data = runner.report(rows, settings)
    if forward is not None:
        data["forward"] = forward
    print(runner.format_table(data))
    (out / "bench.json").write_text(json.dumps(data, indent=2))
    runner.plot(data, str(out / "bench.png"))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}", file=sys.stderr)
    return 0


def add_spec_options(parser: argparse.ArgumentParser) -> None:
    """One flag per SpecConfig field (defaults and their reasons live in codespec/config.py).
    Flags default to None so that a config file's value stands unless the flag is given."""
    from dataclasses import fields

    defaults = SpecConfig()
    for field in fields(SpecConfig):
        if field.name == "spec":
            continue
        default = getattr(defaults, field.name)
        flag = "--" + field.name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"(default {default})")
            continue
        if field.name in ("draft_max", "draft_min"):
            kind = bounded_int(1, DRAFT_MAX_LIMIT)
        else:
            kind = type(default) if default is not None else str
        parser.add_argument(flag, type=kind, default=None, help=f"(default {default})")


def settings_from_args(args) -> tuple[ModelConfig, SpecConfig, SamplingParams]:
    """Defaults (codespec/config.py), then the --config file, then the flags given."""
    from dataclasses import fields

    from .config import load_toml

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
        try:
            settings = cls(**values)
            if hasattr(settings, "validate"):
                settings.validate()
        except ValueError as exc:
            raise CodespecError(str(exc)) from None
        built.append(settings)
    return tuple(built)


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
    from .engine import Engine

    prompt = read_prompt(args)
    model_config, spec, params = settings_from_args(args)
    engine = Engine.load(model_config, spec, show_progress=sys.stderr.isatty())
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

    from .drafters.ngram_cache import build_static_cache, save_static_cache
    from .models import model_source, pull

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

    from .memory import return_freed_memory

    return_freed_memory()  # a long-running process: freed buffers go back to the system (memory.py)

    tcp = None
    if args.tcp is not None:
        host, _, port = args.tcp.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise CodespecError(f"--tcp wants HOST:PORT, got {args.tcp!r}")
        tcp = (host, int(port))
    given = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name) is not None}
    try:
        model_config = ModelConfig(**given)
        model_config.validate()
    except ValueError as exc:
        raise CodespecError(str(exc)) from None
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


def run_serve(args) -> int:
    if args.replicas:
        try:
            from .replicas.deploy import run_replicas
        except ImportError as exc:
            raise CodespecError(f"--replicas needs Ray Serve: pip install 'codespec[replicas]' ({exc})") from None
        return run_replicas(args)
    import uvicorn

    from .engine import Engine
    from .memory import return_freed_memory
    from .models import DEFAULT_ALIASES, DEFAULT_NAME
    from .server import create_app, uvicorn_options

    return_freed_memory()  # a long-running process: freed buffers go back to the system (memory.py)

    model_config, spec, params = settings_from_args(args)
    config = server_config(args)
    engine = Engine.load(model_config, spec, show_progress=sys.stderr.isatty())
    engine.cache_reuse = args.cache_reuse
    name = DEFAULT_NAME if model_config.model in DEFAULT_ALIASES else model_config.model
    aliases = DEFAULT_ALIASES if model_config.model in DEFAULT_ALIASES else ()  # smollm2, default
    app = create_app(engine, config, params, spec, model_name=name, model_aliases=aliases)
    print(f"codespec: serving {name} on http://{config.host}:{config.port} (/infill, /v1/completions, "
          f"/v1/chat/completions, /metrics, /slots)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning", **uvicorn_options(config))
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        raise CodespecError(f"cannot serve on {config.host}:{config.port} (is the port in use?)") from exc
    return 0


def server_config(args) -> ServerConfig:
    """`codespec serve`'s ServerConfig from its arguments, checked (a bad value stops the start with one line)."""
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key or None, max_queue=args.max_queue,
                          parallel=args.parallel, slots=args.slots, session_memory=args.session_memory << 20,
                          allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                          read_timeout=args.read_timeout, n_predict=serve_n_predict(args))
    try:
        config.validate()
    except ValueError as exc:
        raise CodespecError(str(exc)) from None
    return config


def serve_n_predict(args) -> int:
    """--n-predict, else the --config file's [sampling] max_tokens (the server's default length before there was
    --n-predict), else -1."""
    if args.n_predict is not None:
        return args.n_predict
    from .config import load_toml

    loaded = load_toml(args.config) if args.config else {}  # read (and checked) by settings_from_args already
    return loaded.get("sampling", {}).get("max_tokens", ServerConfig.n_predict)


def run_pull(args) -> int:
    from .models import pull

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
    """transformers' own progress bars and warnings would bury our one-line messages."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
