"""Run every configuration on every workload, interleaved in one process, and report medians."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..config import SamplingParams, SpecConfig
from ..engine import Engine
from .workloads import Workload


@dataclass
class Run:
    seconds: float
    tokens: list[int]
    forwards: int | None = None
    drafted: int | None = None
    accepted: int | None = None


@dataclass
class Row:
    workload: str
    config: str
    runs: list[Run] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return statistics.median(run.seconds for run in self.runs)

    @property
    def tokens(self) -> int:
        return len(self.runs[0].tokens)


def codespec_config(spec: SpecConfig):
    def run(engine: Engine, prompt: list[int], max_tokens: int) -> Run:
        result = engine.generate(prompt, SamplingParams(max_tokens=max_tokens), spec=spec)
        stats = result.stats
        return Run(stats.seconds, result.tokens, stats.target_forwards, stats.drafted_tokens, stats.accepted_tokens)
    return run


def transformers_config(**options):
    """transformers' own generate on the same model object: the baseline users already have."""
    def run(engine: Engine, prompt: list[int], max_tokens: int) -> Run:
        inputs = torch.tensor([prompt], device=engine.model.device)
        started = time.perf_counter()
        out = engine.model.generate(inputs, max_new_tokens=max_tokens, do_sample=False,
                                    pad_token_id=engine.tokenizer.eos_token_id, **options)
        return Run(time.perf_counter() - started, out[0, len(prompt):].tolist())
    return run


def default_configs(draft_max: int) -> dict:
    return {
        "plain (codespec none)": codespec_config(SpecConfig(spec=("none",))),
        "codespec prompt-lookup": codespec_config(SpecConfig(spec=("prompt-lookup",), draft_max=draft_max)),
        "transformers generate": transformers_config(),
        "transformers prompt_lookup_num_tokens=10": transformers_config(prompt_lookup_num_tokens=10),
    }


def run_bench(engine: Engine, workloads: list[Workload], configs: dict, repeats: int, max_tokens: int,
              progress=None) -> list[Row]:
    rows = {(w.name, name): Row(w.name, name) for w in workloads for name in configs}
    for workload in workloads:
        prompt = engine.encode(workload.prompt, chat=workload.chat)
        for _ in range(repeats):  # interleaved, so drift in machine speed hits every config alike
            for name, run in configs.items():
                rows[(workload.name, name)].runs.append(run(engine, prompt, max_tokens))
                if progress is not None:
                    progress.update()
    return list(rows.values())


def report(rows: list[Row], max_tokens: int, device: str, dtype: str) -> dict:
    """Ratios against plain greedy (codespec none) and against transformers' prompt lookup."""
    by_workload: dict[str, dict[str, Row]] = {}
    for row in rows:
        by_workload.setdefault(row.workload, {})[row.config] = row
    results = []
    for workload, configs in by_workload.items():
        plain = configs["plain (codespec none)"]
        hf_plain = configs["transformers generate"]
        hf_lookup = configs["transformers prompt_lookup_num_tokens=10"]
        reference = plain.runs[0].tokens
        for name, row in configs.items():
            first = row.runs[0]
            results.append({
                "workload": workload,
                "config": name,
                "tokens": row.tokens,
                "seconds_median": round(row.seconds, 4),
                "tokens_per_second": round(row.tokens / row.seconds, 2),
                "tokens_per_forward": round(row.tokens / first.forwards, 3) if first.forwards else None,
                "acceptance": round(first.accepted / first.drafted, 3) if first.drafted else None,
                "speedup_vs_plain": round(plain.seconds / row.seconds, 3),
                "speedup_vs_transformers_plain": round(hf_plain.seconds / row.seconds, 3),
                "speedup_vs_transformers_prompt_lookup": round(hf_lookup.seconds / row.seconds, 3),
                "identical_to_plain": all(run.tokens == reference for run in row.runs),
                "repeats": len(row.runs),
            })
    return {"max_tokens": max_tokens, "device": device, "dtype": dtype, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(), "results": results}


def format_table(summary: dict) -> str:
    header = f"{'workload':28} {'config':42} {'tok/s':>7} {'tok/fwd':>7} {'accept':>6} {'vs plain':>8} {'vs hf-pld':>9} same"
    lines = [header, "-" * len(header)]
    for r in summary["results"]:
        tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] else "-"
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        lines.append(f"{r['workload']:28} {r['config']:42} {r['tokens_per_second']:7.1f} {tpf:>7} {acc:>6} "
                     f"{r['speedup_vs_plain']:7.2f}x {r['speedup_vs_transformers_prompt_lookup']:8.2f}x "
                     f"{'yes' if r['identical_to_plain'] else 'NO'}")
    return "\n".join(lines)
