"""The command line's argument types and shared option groups: light (no torch), so that the parsers of
`codespec` (cli/options.py) and `codespec bench` (bench/command.py) build from them without importing either."""

from __future__ import annotations

import argparse

from ..config import (ACTIVATIONS_CHOICES, CACHE_TYPES, DEFAULT_MODEL, DRAFT_MAX_LIMIT, FORWARD_CHOICES,
                      INVARIANT_CHOICES, PROMPT_PRECISION_CHOICES, WEIGHTS_CHOICES, SpecConfig, unknown_drafters)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but usage mistakes print one line and exit 2."""

    def error(self, message: str):
        self.exit(2, f"codespec: error: {message}\n")


# llama-server's --spec-type names for codespec's drafters where they differ (ngram-mod, ngram-map-k, ngram-map-k4v,
# ngram-cache and none are the same): its n-gram lookup in the context, and its draft model
LLAMA_SPEC_TYPES = {"ngram-simple": "prompt-lookup", "draft-simple": "draft"}


def llama_spec_list(value: str) -> tuple[str, ...]:
    """--spec-type's list in llama-server's names (or codespec's), as codespec's chain."""
    return spec_list(",".join(LLAMA_SPEC_TYPES.get(name.strip(), name.strip()) for name in value.split(",")))


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


# llama-server's KV cache types that codespec has, in llama-server's spelling and its own
LLAMA_CACHE_TYPES = {"f32": "f32", "f16": "f16", "q8_0": "q8", "q8": "q8", "auto": "auto"}


def llama_cache_type(value: str) -> str:
    """-ctk/-ctv's TYPE as codespec's --cache-type."""
    if value.lower() not in LLAMA_CACHE_TYPES:
        raise argparse.ArgumentTypeError(f"codespec's cache types are f32, f16 and q8_0 (its q8), not {value!r}")
    return LLAMA_CACHE_TYPES[value.lower()]


class OneCacheType(argparse.Action):
    """--cache-type, -ctk and -ctv all set codespec's one cache type (keys and values alike): giving two of them
    different values is a usage error, not a silent choice."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest, None)
        if given is not None and given != values:
            parser.error(f"{option_string} {values} differs from the cache type given before ({given}): codespec "
                         "keeps keys and values in one type")
        setattr(namespace, self.dest, values)


def add_model_options(parser: argparse.ArgumentParser, llama_server: bool = False) -> None:
    """llama_server: also llama-server's spellings (-m, -ctk/--cache-type-k, -ctv/--cache-type-v)."""
    parser.add_argument("--model", *(("-m",) if llama_server else ()),
                        help=f"{DEFAULT_MODEL} (default, embedded), a transformers directory, "
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
                             "bfloat16 values in float32) or gguf (the GGUF's own blocks, as llama-server reads them: "
                             "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; CPU, float32, lean forward; with "
                             "--invariant on, the default, the file is read directly, no conversion)")
    parser.add_argument("--prompt-precision", choices=PROMPT_PRECISION_CHOICES,
                        help="how prompt chunks of more than 16 tokens are multiplied on a CPU in float32: auto "
                             "(default: bfloat16 where it measures faster), float32, or bfloat16 (inputs and weights "
                             "rounded to bfloat16, float32 sums); generated tokens always use float32")
    parser.add_argument("--cache-type", choices=CACHE_TYPES, action=OneCacheType if llama_server else "store",
                        help="the KV cache's element type: auto (default: f16 where it runs, else f32), f32 (the "
                             "model's dtype), f16 (llama.cpp's default: half the memory and of what attention "
                             "reads; CPU, float32, lean forward) or q8 (8-bit integers and a scale per key and value, "
                             "as llama.cpp's q8_0: 53%% of f16's bytes; with --activations q8)")
    if llama_server:
        for flags, what in ((("-ctk", "--cache-type-k"), "keys"), (("-ctv", "--cache-type-v"), "values")):
            parser.add_argument(*flags, dest="cache_type", type=llama_cache_type, action=OneCacheType,
                                metavar="TYPE", help=f"llama-server's cache type for {what}: f32, f16 or q8_0; "
                                                     "codespec has one type for both (--cache-type)")
    parser.add_argument("--invariant", choices=INVARIANT_CHOICES,
                        help="on (default): every CPU forward in per-row kernels, prompts included, so the text does "
                             "not depend on how a prompt was chunked, batched with other sessions or cached (prefill "
                             "about 2x slower on AVX2 CPUs); off: long prompt chunks in faster GEMMs whose bits "
                             "depend on the chunk")
    parser.add_argument("--activations", choices=ACTIVATIONS_CHOICES,
                        help="what a GGUF's blocks multiply: auto (default: q8 where the CPU has AVX2 or AVX512-VNNI), q8 "
                             "(inputs rounded to 8 bits per 32 and exact integer sums, as llama.cpp multiplies them) "
                             "or float32")


LLAMA_SPEC_FLAGS = {"draft_model": ("-md", "--model-draft")}  # llama-server's spellings of SpecConfig's flags


def add_spec_options(parser: argparse.ArgumentParser, llama_server: bool = False) -> None:
    """One flag per SpecConfig field (defaults and their reasons live in codespec/config.py).
    Flags default to None so that a config file's value stands unless the flag is given. llama_server: also
    llama-server's spellings (LLAMA_SPEC_FLAGS)."""
    from dataclasses import fields

    defaults = SpecConfig()
    for field in fields(SpecConfig):
        if field.name == "spec":
            continue
        default = getattr(defaults, field.name)
        flag = "--" + field.name.replace("_", "-")
        flags = (flag, *(LLAMA_SPEC_FLAGS.get(field.name, ()) if llama_server else ()))
        if isinstance(default, bool):
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None,
                                help=f"(default {default})")
            continue
        if field.name in ("draft_max", "draft_min", "prediction_draft_max"):
            kind = bounded_int(1, DRAFT_MAX_LIMIT)
        else:
            kind = type(default) if default is not None else str
        parser.add_argument(*flags, type=kind, default=None, help=f"(default {default})")
