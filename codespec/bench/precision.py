"""How often codespec's rounding changes greedy output: long prompts multiplied in bfloat16 (--prompt-precision),
keys and values kept in float16 (--cache-type) and activations rounded to 8 bits (--activations q8), each alone,
the default (on CPUs with AVX512-VNNI: q8 activations and a float16 cache) and the default with a q8 cache
(--cache-type q8), against float32 throughout (and the q8 cache against the default), on every bench workload's
first turn, with plain greedy decoding; and what each rounding costs the model: its mean log loss on a real file
(the standard library's textwrap.py, teacher-forced through prompt chunks of 128 tokens).

    python -m codespec.bench.precision [--max-tokens 256] [--out FILE]

Speculation is not involved: speculative output equals plain output in each setting (tested). This measures what
the rounding itself changes, against float32, where the lean path equals transformers' own output.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import torch

from ..config import ModelConfig, SamplingParams, SpecConfig
from ..engine import Engine
from ..forward import Rows
from .workloads import EDITS, FREE_FORM, PROSE, all_workloads

EXACT = ("float32", "f32", "float32")
DEFAULT = (ModelConfig.prompt_precision, ModelConfig.cache_type, ModelConfig.activations)
VARIANTS = {"bfloat16 prompts": ("bfloat16", "f32", "float32"), "float16 cache": ("float32", "f16", "float32"),
            "q8 activations": ("float32", "f32", "q8"), "default": DEFAULT,
            "q8 cache": (DEFAULT[0], "q8", "q8")}  # (prompt precision, cache, activations); q8 cache: with q8 activations


def use(engine: Engine, setting: tuple[str, str, str]) -> None:
    engine.path.use_activations(setting[2])
    engine.path.use_prompt_precision(setting[0])
    engine.path.use_cache_type(setting[1])


def run(engine: Engine, prompt: list[int], params: SamplingParams, setting: tuple[str, str, str]
        ) -> tuple[list[int], float]:
    use(engine, setting)
    result = engine.generate(prompt, params, spec=SpecConfig(spec=("none",)))
    return result.tokens, result.stats.prefill_seconds


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(engine: Engine, max_tokens: int) -> list[dict]:
    params = SamplingParams(max_tokens=max_tokens)
    rows = []
    try:
        for workload in all_workloads(per_class=max(len(EDITS), len(FREE_FORM), len(PROSE))):
            prompt = engine.encode(workload.turns[0], chat=workload.chat)
            exact, seconds = run(engine, prompt, params, EXACT)
            row = {"workload": workload.name, "prompt_tokens": len(prompt), "tokens": len(exact),
                   "prefill_seconds": {"float32": round(seconds, 3)}, "first_difference": {}}
            outputs = {}
            for name, setting in VARIANTS.items():
                tokens, seconds = run(engine, prompt, params, setting)
                outputs[name] = tokens
                row["first_difference"][name] = first_difference(exact, tokens)
                row["prefill_seconds"][name] = round(seconds, 3)
            # the q8 cache against the default's float16 one (both with q8 activations)
            row["q8_cache_vs_default"] = first_difference(outputs["default"], outputs["q8 cache"])
            rows.append(row)
    finally:
        use(engine, DEFAULT)
    return rows


def log_loss(engine: Engine, setting: tuple[str, str, str], tokens: int = 3000, chunk: int = 128) -> float:
    """Mean negative log-likelihood (nats per token) of textwrap.py's first `tokens` tokens, each predicted from
    the ones before it through prompt chunks of `chunk`."""
    use(engine, setting)
    ids = engine.tokenizer(Path(textwrap.__file__).read_text())["input_ids"][:tokens]
    cache, total = engine.path.new_cache(), 0.0
    with torch.no_grad():
        for first in range(0, len(ids) - 1, chunk):
            rows = ids[first : first + chunk]
            targets = torch.tensor(ids[first + 1 : first + 1 + len(rows)])
            logits = engine.path.batch([Rows(cache, rows, len(rows), prompt=True)])[0][: len(targets)]
            total -= torch.log_softmax(logits.double(), -1)[torch.arange(len(targets)), targets].sum().item()
    return total / (len(ids) - 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m codespec.bench.precision", description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    engine = Engine.load(show_progress=False)
    rows = compare(engine, args.max_tokens)
    try:
        losses = {name: round(log_loss(engine, setting), 5) for name, setting in [("float32", EXACT), *VARIANTS.items()]}
    finally:
        use(engine, DEFAULT)
    print("first token that differs from float32 throughout ('-': none), and prefill seconds")
    print(f"{'workload':34} {'prompt':>6}" + "".join(f" {name:>17}" for name in VARIANTS) + f" {'prefill f32':>11}"
          + "".join(f" {name[:11]:>11}" for name in VARIANTS))
    for row in rows:
        cells = ["-" if row["first_difference"][name] is None else str(row["first_difference"][name])
                 for name in VARIANTS]
        print(f"{row['workload']:34} {row['prompt_tokens']:6}" + "".join(f" {c:>17}" for c in cells)
              + "".join(f" {row['prefill_seconds'][name]:11.3f}" for name in ["float32", *VARIANTS]))
    identical = {name: sum(row["first_difference"][name] is None for row in rows) for name in VARIANTS}
    identical["q8 cache vs default"] = sum(row["q8_cache_vs_default"] is None for row in rows)
    for name, count in identical.items():
        print(f"identical greedy output, {name}: {count} of {len(rows)} workloads")
    print("log loss on textwrap.py (nats per token): " + ", ".join(
        f"{name} {loss:.5f}" + ("" if name == "float32" else f" ({loss - losses['float32']:+.5f})")
        for name, loss in losses.items()))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"max_tokens": args.max_tokens, "identical": identical, "log_loss": losses, "rows": rows},
                      handle, indent=1)


if __name__ == "__main__":
    main()
