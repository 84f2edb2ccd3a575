"""Run every configuration on every workload, interleaved in one process, and report medians as ratios."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from ..config import SamplingParams, SpecConfig
from ..engine import Engine
from .workloads import Workload

PLAIN = "plain"
HF_LOOKUP = "transformers prompt lookup"
DEFAULT_CHAIN = "codespec default"
FIXED_CHAIN = "default fixed-length"
DRAFT_QUARTER = "draft (first quarter of layers)"  # the target's first layers as its own draft model
NEVER_SLOWER = 0.97  # a codespec config whose paired speed ratio falls below this on a workload is reported


@dataclass
class Config:
    name: str
    spec: SpecConfig | None = None  # a codespec configuration
    hf_options: dict | None = None  # or transformers' own generate with these options


@dataclass
class Run:
    seconds: float
    tokens: list[int]
    forwards: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    prefill_seconds: float = 0.0  # time to each turn's first token: the same work for every config
    turns: int = 0
    outside_forwards: float = 0.0  # seconds outside target forwards (codespec configs)

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.prefill_seconds

    @property
    def decode_tokens(self) -> int:
        return len(self.tokens) - self.turns  # each turn's first token comes with its prefill


class FirstTokenClock:
    """A transformers streamer that notes when generate() emits its first new token."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class Row:
    workload: Workload
    config: str
    runs: list[Run] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return statistics.median(run.seconds for run in self.runs)

    @property
    def decode_seconds(self) -> float:
        return statistics.median(run.decode_seconds for run in self.runs)


def build_configs(quick: bool, draft_max: int, default_spec: SpecConfig, layers: int = 30) -> list[Config]:
    """layers: the target's layer count; the draft model config uses its first quarter."""
    def spec(*names):
        return SpecConfig(spec=names, draft_max=draft_max)

    configs = [Config(PLAIN, spec("none")), Config(HF_LOOKUP, hf_options={"prompt_lookup_num_tokens": 10}),
               Config(DEFAULT_CHAIN, default_spec), Config(FIXED_CHAIN, replace(default_spec, adaptive=False)),
               Config("prompt-lookup", spec("prompt-lookup"))]
    if not quick:
        configs += [
            Config(name, spec(name)) for name in ("ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache")]
        # a draft model is always at hand: the target's own first layers, sharing its weights
        configs.append(Config(DRAFT_QUARTER, replace(spec("draft"), draft_layers=max(1, layers // 4))))
    return configs


def run_workload(engine: Engine, workload: Workload, config: Config, max_tokens: int, turns: int) -> Run:
    """All turns of a workload in one fresh session (and a fresh pool), as one user would see them."""
    engine.shared.pool.reset()
    session_id = f"bench-{time.monotonic_ns()}"
    messages: list[dict] = []
    total = Run(0.0, [], 0, 0, 0) if config.spec else Run(0.0, [])
    total.turns = len(workload.turns[:turns])
    params = SamplingParams(max_tokens=max_tokens)
    for turn in workload.turns[:turns]:
        if workload.chat:
            messages.append({"role": "user", "content": turn})
            prompt = list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        else:
            prompt = engine.encode(turn)
        if config.spec is not None:
            result = engine.generate(prompt, params, session_id=session_id, spec=config.spec)
            tokens, stats = result.tokens, result.stats
            total.seconds += stats.seconds
            total.prefill_seconds += stats.prefill_seconds
            total.outside_forwards += stats.seconds - stats.forward_seconds
            total.forwards += stats.target_forwards
            total.drafted += stats.drafted_tokens
            total.accepted += stats.accepted_tokens
        else:
            inputs = torch.tensor([prompt], device=engine.model.device)
            clock = FirstTokenClock()
            started = time.perf_counter()
            out = engine.model.generate(inputs, max_new_tokens=max_tokens, do_sample=False, streamer=clock,
                                        eos_token_id=sorted(engine.eos_token_ids),
                                        pad_token_id=min(engine.eos_token_ids), **config.hf_options)
            total.seconds += time.perf_counter() - started
            total.prefill_seconds += (clock.first or time.perf_counter()) - started
            tokens = out[0, len(prompt):].tolist()
        total.tokens += tokens
        messages.append({"role": "assistant", "content": engine.tokenizer.decode(tokens, skip_special_tokens=True)})
    engine.drop(session_id, pool="keep")  # its KV cache goes: hundreds of runs would otherwise fill the memory
    return total


def run_bench(engine: Engine, workloads: list[Workload], configs: list[Config], repeats: int, max_tokens: int,
              turns: int = 5, progress=None) -> list[Row]:
    rows = {(w.name, c.name): Row(w, c.name) for w in workloads for c in configs}
    for workload in workloads:
        for round_ in range(repeats):  # interleaved, so drift in machine speed hits every config alike
            # and each round starts one config later: what running after another config costs (the memory it left,
            # the caches it filled) falls on a different config each round instead of always on the same one
            for config in configs[round_ % len(configs):] + configs[:round_ % len(configs)]:
                rows[(workload.name, config.name)].runs.append(run_workload(engine, workload, config, max_tokens, turns))
                if progress is not None:
                    progress.update()
    return list(rows.values())


def report(rows: list[Row], settings: dict) -> dict:
    """Ratios against plain greedy and against transformers' prompt lookup, per workload and per class."""
    by_workload: dict[str, dict[str, Row]] = {}
    for row in rows:
        by_workload.setdefault(row.workload.name, {})[row.config] = row
    results = []
    for workload, configs in by_workload.items():
        plain, hf_lookup = configs[PLAIN], configs[HF_LOOKUP]
        reference = plain.runs[0].tokens
        for name, row in configs.items():
            first = row.runs[0]
            results.append({
                "workload": workload,
                "kind": row.workload.kind,
                "config": name,
                "tokens": len(first.tokens),
                "seconds_median": round(row.seconds, 4),
                "tokens_per_second": round(len(first.tokens) / row.seconds, 2),
                "decode_tokens_per_second": round(first.decode_tokens / row.decode_seconds, 2),
                "prefill_seconds_median": round(statistics.median(run.prefill_seconds for run in row.runs), 4),
                "tokens_per_forward": round(len(first.tokens) / first.forwards, 3) if first.forwards else None,
                "acceptance": round(first.accepted / first.drafted, 3) if first.drafted else None,
                "speedup_vs_plain": round(plain.seconds / row.seconds, 3),
                # the median over rounds of plain's time over this config's in the same round: runs next to each
                # other share the machine's state, so slow drift and a busy neighbour cancel out
                "paired_speedup_vs_plain": round(statistics.median(
                    p.seconds / r.seconds for p, r in zip(plain.runs, row.runs)), 3),
                "speedup_vs_transformers_prompt_lookup": round(hf_lookup.seconds / row.seconds, 3),
                "decode_speedup_vs_plain": round(plain.decode_seconds / row.decode_seconds, 3),
                "decode_speedup_vs_transformers_prompt_lookup": round(hf_lookup.decode_seconds / row.decode_seconds, 3),
                "outside_forwards_share": (round(statistics.median(run.outside_forwards / run.seconds
                                                                   for run in row.runs), 4)
                                           if first.forwards else None),
                "identical_to_plain": all(run.tokens == reference for run in row.runs),
                "repeats": len(row.runs),
            })
    classes: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        classes.setdefault((r["kind"], r["config"]), []).append(r)
    summary = [{"kind": kind, "config": config,
                **{f"median_{key}": round(statistics.median(r[key] for r in members), 3)
                   for key in ("speedup_vs_plain", "paired_speedup_vs_plain", "decode_speedup_vs_plain",
                               "decode_tokens_per_second", "speedup_vs_transformers_prompt_lookup")},
                "worst_paired_speedup_vs_plain": min(r["paired_speedup_vs_plain"] for r in members),
                "identical_share": round(sum(r["identical_to_plain"] for r in members) / len(members), 3),
                "all_identical_to_plain": all(r["identical_to_plain"] for r in members)}
               for (kind, config), members in classes.items()]
    slower = [f"{s['kind']}/{s['config']} {s['worst_paired_speedup_vs_plain']:.2f}x" for s in summary
              if s["config"] != HF_LOOKUP and s["worst_paired_speedup_vs_plain"] < NEVER_SLOWER]
    machine = {"device": str(settings["device"]), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "machine": platform.machine()}
    return {**settings, **machine, "results": results, "by_class": summary, "slower_than_plain": slower}


def format_table(data: dict) -> str:
    """Speedups end to end (prefill included) and for decoding alone (after each turn's first token)."""
    header = (f"{'workload':26} {'config':27} {'tok/s':>6} {'dec t/s':>7} {'tok/fwd':>7} {'accept':>6} "
              f"{'vs plain':>8} {'dec vs plain':>12} {'vs hf-pld':>9} same")
    lines = [header, "-" * len(header)]
    for r in data["results"]:
        tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] else "-"
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        lines.append(f"{r['workload']:26} {r['config']:27} {r['tokens_per_second']:6.1f} "
                     f"{r['decode_tokens_per_second']:7.1f} {tpf:>7} {acc:>6} {r['speedup_vs_plain']:7.2f}x "
                     f"{r['decode_speedup_vs_plain']:11.2f}x {r['speedup_vs_transformers_prompt_lookup']:8.2f}x "
                     f"{'yes' if r['identical_to_plain'] else 'NO'}")
    lines += ["", f"{'class':12} {'config':32} {'vs plain':>8} {'paired':>7} {'worst':>6} {'dec vs plain':>12} "
                  f"{'dec t/s':>7} {'vs hf-pld':>9} {'same':>5}", "-" * 108]
    for s in data["by_class"]:
        lines.append(f"{s['kind']:12} {s['config']:32} {s['median_speedup_vs_plain']:7.2f}x "
                     f"{s['median_paired_speedup_vs_plain']:6.2f}x {s['worst_paired_speedup_vs_plain']:5.2f}x "
                     f"{s['median_decode_speedup_vs_plain']:11.2f}x {s['median_decode_tokens_per_second']:7.1f} "
                     f"{s['median_speedup_vs_transformers_prompt_lookup']:8.2f}x {s['identical_share']:5.0%}")
    slower = data.get("slower_than_plain") or []
    lines += ["", f"slower than {NEVER_SLOWER}x of plain (paired, worst workload): "
                  f"{', '.join(slower) if slower else 'none'}"]
    return "\n".join(lines)


def plot(data: dict, path: str) -> None:
    """Grouped bars of speedup over plain greedy, per workload and configuration: end to end (prefill
    included) above, decoding alone below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in data["results"]))
    configs = [c for c in dict.fromkeys(r["config"] for r in data["results"]) if c != PLAIN]
    width = 0.8 / len(configs)
    figure, panels = plt.subplots(2, 1, figsize=(max(9, 1.7 * len(workloads)), 8), sharex=True)
    for axes, key, label in ((panels[0], "speedup_vs_plain", "end to end"),
                             (panels[1], "decode_speedup_vs_plain", "decoding (after the first token)")):
        speedup = {(r["workload"], r["config"]): r.get(key, 0) for r in data["results"]}
        for index, config in enumerate(configs):
            xs = [w + (index - (len(configs) - 1) / 2) * width for w in range(len(workloads))]
            axes.bar(xs, [speedup.get((w, config), 0) for w in workloads], width, label=config)
        axes.axhline(1.0, color="black", linewidth=0.8)
        axes.set_ylabel(f"speedup over plain\n{label}")
    panels[1].set_xticks(range(len(workloads)), workloads, rotation=20, ha="right", fontsize=8)
    panels[0].set_title(f"codespec bench ({data['device']}, {data['dtype']}, {data['max_tokens']} tokens, "
                        f"median of {data['repeats']})")
    panels[0].legend(fontsize=7, ncol=3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
