"""Two sessions, one pool: session A rewrites a file, then session B rewrites the same file.

This is where a pool shared across sessions should pay: B's output repeats what A wrote, not only what
B's prompt holds. Each configuration starts from an empty pool; B is measured (A only feeds the pool).
"""

from __future__ import annotations

from ..config import SamplingParams, SpecConfig
from ..engine import Engine
from .workloads import EDITS, edit_request

REQUESTS = {  # what B asks for, after A asked for the first edit of EDITS
    "same request": None,
    "other request": "adding a docstring",
}

CONFIGS = {
    "none": SpecConfig(spec=("none",)),
    "prompt-lookup": SpecConfig(spec=("prompt-lookup",)),
    "ngram-mod": SpecConfig(spec=("ngram-mod",)),
    "prompt-lookup,ngram-mod": SpecConfig(spec=("prompt-lookup", "ngram-mod")),
    "ngram-mod,prompt-lookup": SpecConfig(spec=("ngram-mod", "prompt-lookup")),
}


def run_two_session(engine: Engine, max_tokens: int, configs: dict | None = None, progress=None) -> list[dict]:
    params = SamplingParams(max_tokens=max_tokens)
    module, qualname, first_change = EDITS[0]
    rows = []
    for request, second_change in REQUESTS.items():
        prompt_a = engine.encode(edit_request(module, qualname, first_change), chat=True)
        prompt_b = engine.encode(edit_request(module, qualname, second_change or first_change), chat=True)
        plain_b = None
        for name, spec in (configs or CONFIGS).items():
            engine.shared.pool.reset()  # every configuration starts from an empty pool
            engine.generate(prompt_a, params, session_id=f"A-{name}-{request}", spec=spec)
            b = engine.generate(prompt_b, params, session_id=f"B-{name}-{request}", spec=spec)
            plain_b = plain_b or b
            stats = b.stats
            rows.append({
                "scenario": request, "config": name, "tokens": stats.generated_tokens,
                "tokens_per_forward": round(stats.tokens_per_forward, 3),
                "acceptance": round(stats.acceptance_rate, 3),
                "seconds": round(stats.seconds, 3),
                "speedup_vs_none": round(plain_b.stats.seconds / stats.seconds, 3),
                "identical_to_none": b.tokens == plain_b.tokens,
                "draft_ms_per_call": {d.name: round(d.draft_s / d.calls * 1e3, 4) if d.calls else None
                                      for d in stats.drafters},
            })
            if progress is not None:
                progress.update()
    return rows


def format_rows(rows: list[dict]) -> str:
    header = f"{'session B':14} {'config':24} {'tok/fwd':>7} {'accept':>6} {'vs none':>7} same  draft ms/call"
    lines = [header, "-" * len(header)]
    for r in rows:
        per_call = ", ".join(f"{k} {v}" for k, v in r["draft_ms_per_call"].items() if v is not None)
        lines.append(f"{r['scenario']:14} {r['config']:24} {r['tokens_per_forward']:7.2f} {r['acceptance']:6.2f} "
                     f"{r['speedup_vs_none']:6.2f}x {'yes ' if r['identical_to_none'] else 'NO  '}  {per_call}")
    return "\n".join(lines)
