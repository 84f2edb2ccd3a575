"""codespec command line: pull | generate."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import DEFAULT_MODEL, DRAFT_MAX_LIMIT, SPEC_CHOICES, ModelConfig, SamplingParams, SpecConfig
from .errors import CodespecError


class OneLineParser(argparse.ArgumentParser):
    """argparse, but usage mistakes print one line and exit 2."""

    def error(self, message: str):
        self.exit(2, f"codespec: error: {message}\n")


def spec_list(value: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in names if name not in SPEC_CHOICES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown spec {','.join(unknown) or value!r}; choose from {', '.join(SPEC_CHOICES)}")
    return names


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


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="smollm2 (default, embedded), a transformers directory, a .gguf file, or a hub id")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, float16")


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
    defaults, sampling = SpecConfig(), SamplingParams()
    gen.add_argument("--spec", type=spec_list, default=defaults.spec,
                     help=f"comma-separated drafter chain from: {', '.join(SPEC_CHOICES)} (default %(default)s)")
    gen.add_argument("--draft-max", type=bounded_int(1, DRAFT_MAX_LIMIT), default=defaults.draft_max)
    gen.add_argument("--draft-min", type=bounded_int(1, DRAFT_MAX_LIMIT), default=defaults.draft_min)
    gen.add_argument("--ngram-min", type=bounded_int(1, 64), default=defaults.ngram_min)
    gen.add_argument("--ngram-max", type=bounded_int(1, 64), default=defaults.ngram_max)
    gen.add_argument("--max-tokens", type=bounded_int(1, 1 << 20), default=sampling.max_tokens)
    gen.add_argument("--temperature", type=float, default=sampling.temperature)
    gen.add_argument("--top-k", type=int, default=sampling.top_k)
    gen.add_argument("--top-p", type=float, default=sampling.top_p)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, tokens and stats")
    bench = commands.add_parser("bench", help="measure speculation against plain decoding and transformers")
    add_model_options(bench)
    bench.add_argument("--workloads", type=bounded_int(1, 3), default=1, help="edit workloads to run (1-3)")
    bench.add_argument("--repeats", type=bounded_int(1, 50), default=3, help="runs per configuration (median)")
    bench.add_argument("--max-tokens", type=bounded_int(1, 4096), default=256)
    bench.add_argument("--draft-max", type=bounded_int(1, DRAFT_MAX_LIMIT), default=defaults.draft_max)
    bench.add_argument("--json", dest="json_path", help="also write the results to this JSON file")
    return parser


def run_bench(args) -> int:
    from tqdm.auto import tqdm

    from .bench.runner import default_configs, format_table, report, run_bench as bench
    from .bench.workloads import edit_workloads
    from .engine import Engine

    engine = Engine.load(ModelConfig(model=args.model, device=args.device, dtype=args.dtype))
    workloads = edit_workloads(args.workloads)
    configs = default_configs(args.draft_max)
    with tqdm(total=len(workloads) * len(configs) * args.repeats, desc="bench", unit="run") as progress:
        rows = bench(engine, workloads, configs, args.repeats, args.max_tokens, progress)
    summary = report(rows, args.max_tokens, str(engine.model.device), str(engine.model.dtype))
    print(format_table(summary))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2)
    return 0


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
    spec = SpecConfig(spec=args.spec, draft_max=args.draft_max, draft_min=args.draft_min,
                      ngram_min=args.ngram_min, ngram_max=args.ngram_max)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    for check in (spec.validate, params.validate):
        try:
            check()
        except ValueError as exc:
            raise CodespecError(str(exc)) from None
    engine = Engine.load(ModelConfig(model=args.model, device=args.device, dtype=args.dtype), spec,
                         show_progress=sys.stderr.isatty())
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


def run_pull(args) -> int:
    from .models import pull

    path = pull(args.model)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        return {"pull": run_pull, "generate": run_generate, "bench": run_bench}[args.command](args)
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
