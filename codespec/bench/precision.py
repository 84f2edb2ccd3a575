"""How often rounding long prompts to bfloat16 (--prompt-precision bfloat16) changes greedy output: every bench
workload's first turn, plain greedy decoding, prompt chunks in float32 and in bfloat16, side by side.

    python -m codespec.bench.precision [--max-tokens 256] [--out FILE]

Speculation is not involved: speculative output equals plain output in either precision (tested). This measures
what the precision itself changes, against float32 prompts, where the lean path equals transformers' own output.
"""

from __future__ import annotations

import argparse
import json

from ..config import ModelConfig, SamplingParams, SpecConfig
from ..engine import Engine
from .workloads import EDITS, FREE_FORM, PROSE, all_workloads


def compare(engine: Engine, max_tokens: int) -> list[dict]:
    plain, params = SpecConfig(spec=("none",)), SamplingParams(max_tokens=max_tokens)
    rows = []
    for workload in all_workloads(per_class=max(len(EDITS), len(FREE_FORM), len(PROSE))):
        prompt = engine.encode(workload.turns[0], chat=workload.chat)
        out = {}
        for precision in ("float32", "bfloat16"):
            engine.path.use_prompt_precision(precision)
            result = engine.generate(prompt, params, spec=plain)
            out[precision] = (result.tokens, result.stats.prefill_seconds)
        wide, narrow = out["float32"][0], out["bfloat16"][0]
        same = wide == narrow
        first = None if same else next((i for i, (a, b) in enumerate(zip(wide, narrow)) if a != b),
                                       min(len(wide), len(narrow)))
        rows.append({"workload": workload.name, "prompt_tokens": len(prompt), "identical": same,
                     "first_difference": first, "tokens": len(wide),
                     "prefill_seconds": {p: round(out[p][1], 3) for p in out}})
    engine.path.use_prompt_precision(ModelConfig.prompt_precision)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m codespec.bench.precision", description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    engine = Engine.load(show_progress=False)
    rows = compare(engine, args.max_tokens)
    print(f"{'workload':34} {'prompt':>6} {'same':>5} {'first diff':>10} {'prefill f32 s':>13} {'bf16 s':>7}")
    for row in rows:
        first = "-" if row["first_difference"] is None else row["first_difference"]
        print(f"{row['workload']:34} {row['prompt_tokens']:6} {'yes' if row['identical'] else 'no':>5} {first:>10} "
              f"{row['prefill_seconds']['float32']:13.3f} {row['prefill_seconds']['bfloat16']:7.3f}")
    same = sum(row["identical"] for row in rows)
    print(f"identical greedy output with bfloat16 prompts: {same} of {len(rows)} workloads")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"max_tokens": args.max_tokens, "identical": same, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
