"""Run every configuration on every workload, interleaved in one process, and report medians as ratios."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from ..config import SamplingParams, SpecConfig
from ..engine import Engine
from . import llama_server
from .llama_server import PLAIN as PEER_PLAIN, PREFIX as PEER_PREFIX
from .workloads import Run, Workload

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
    server: object | None = None  # or a running llama-server (llama_server.LlamaServer): the side-by-side peer


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
    def spec(*names, **more):
        return SpecConfig(spec=names, draft_max=draft_max, **more)

    configs = [Config(PLAIN, spec("none")), Config(HF_LOOKUP, hf_options={"prompt_lookup_num_tokens": 10}),
               Config(DEFAULT_CHAIN, default_spec), Config(FIXED_CHAIN, replace(default_spec, adaptive=False)),
               Config("prompt-lookup", spec("prompt-lookup"))]
    if not quick:
        configs += [
            Config(name, spec(name)) for name in ("ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache")]
        # a draft model is always at hand: the target's own first layers, sharing its weights
        configs.append(Config(DRAFT_QUARTER, spec("draft", draft_layers=max(1, layers // 4))))
    return configs


def turn_prompt(engine: Engine, workload: Workload, messages: list[dict], turn: str) -> list[int]:
    """A turn's prompt as token ids: the chat so far through the chat template, or the raw text."""
    if workload.chat:
        return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    return engine.encode(turn)


def run_workload(engine: Engine, workload: Workload, config: Config, max_tokens: int, turns: int) -> Run:
    """All turns of a workload in one fresh session (and a fresh pool), as one user would see them."""
    if config.server is not None:
        return llama_server.run_workload(config.server, engine.tokenizer, workload, max_tokens, turns,
                                         lambda messages, turn: turn_prompt(engine, workload, messages, turn))
    engine.shared.pool.reset()
    session_id = f"bench-{time.monotonic_ns()}"
    messages: list[dict] = []
    total = Run(0.0, [], 0, 0, 0) if config.spec else Run(0.0, [])
    total.turns = len(workload.turns[:turns])
    params = SamplingParams(max_tokens=max_tokens)
    for turn in workload.turns[:turns]:
        if workload.chat:
            messages.append({"role": "user", "content": turn})
        prompt = turn_prompt(engine, workload, messages, turn)
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
            out = engine.transformers_model.generate(inputs, max_new_tokens=max_tokens, do_sample=False, streamer=clock,
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


def is_peer(config: str) -> bool:
    """A llama-server row (the side-by-side peer), not one of codespec's or transformers' configurations."""
    return config.startswith(PEER_PREFIX)


def _rate(run_or_row, decode: bool = False) -> float:
    if isinstance(run_or_row, Row):
        first = run_or_row.runs[0]
        return (first.decode_tokens / run_or_row.decode_seconds if decode
                else len(first.tokens) / run_or_row.seconds)
    return run_or_row.decode_tokens / run_or_row.decode_seconds if decode else len(run_or_row.tokens) / run_or_row.seconds


def _speedup(base: Row, row: Row, decode: bool = False) -> float:
    """Time ratio for the same output; tok/s ratio where a llama-server row's output may differ in length."""
    if is_peer(base.config) or is_peer(row.config):
        return _rate(row, decode) / _rate(base, decode)
    return base.decode_seconds / row.decode_seconds if decode else base.seconds / row.seconds


def _paired(base: Row, row: Row) -> float:
    if is_peer(base.config) or is_peer(row.config):
        return statistics.median(_rate(r) / _rate(p) for p, r in zip(base.runs, row.runs))
    return statistics.median(p.seconds / r.seconds for p, r in zip(base.runs, row.runs))


def _server_rate(row: Row, n: str, ms: str) -> float | None:
    rates = [run.server[n] / run.server[ms] * 1000 for run in row.runs if run.server and run.server[ms] > 0]
    return round(statistics.median(rates), 2) if rates else None


def report(rows: list[Row], settings: dict) -> dict:
    """Ratios against plain greedy and against transformers' prompt lookup, per workload and per class; with
    llama-server rows, absolute tok/s of every row against llama-server's plain decoding too."""
    by_workload: dict[str, dict[str, Row]] = {}
    for row in rows:
        by_workload.setdefault(row.workload.name, {})[row.config] = row
    results = []
    for workload, configs in by_workload.items():
        plain, hf_lookup, peer_plain = configs[PLAIN], configs[HF_LOOKUP], configs.get(PEER_PLAIN)
        for name, row in configs.items():
            first = row.runs[0]
            # identity within a family: llama-server's speculation against its own plain decoding (its Q4_1
            # kernels are not codespec's dequantised weights, so its plain text is its own reference)
            reference = (peer_plain if is_peer(name) and peer_plain is not None else plain).runs[0].tokens
            result = {
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
                "speedup_vs_plain": round(_speedup(plain, row), 3),
                # the median over rounds of plain's time over this config's in the same round: runs next to each
                # other share the machine's state, so slow drift and a busy neighbour cancel out
                "paired_speedup_vs_plain": round(_paired(plain, row), 3),
                "speedup_vs_transformers_prompt_lookup": round(_speedup(hf_lookup, row), 3),
                "decode_speedup_vs_plain": round(_speedup(plain, row, decode=True), 3),
                "decode_speedup_vs_transformers_prompt_lookup": round(_speedup(hf_lookup, row, decode=True), 3),
                "outside_forwards_share": (round(statistics.median(run.outside_forwards / run.seconds
                                                                   for run in row.runs), 4)
                                           if first.forwards else None),
                "identical_to_plain": all(run.tokens == reference for run in row.runs),
                "repeats": len(row.runs),
            }
            if peer_plain is not None:
                result["tokens_per_second_vs_llama_server_plain"] = round(_speedup(peer_plain, row), 3)
                result["paired_tokens_per_second_vs_llama_server_plain"] = round(_paired(peer_plain, row), 3)
            if is_peer(name):
                result.update({
                    "identical_to": PEER_PLAIN,
                    "identical_to_codespec_plain": all(run.tokens == plain.runs[0].tokens for run in row.runs),
                    # llama-server's own timings: decoding (predicted_per_second) and prompt processing
                    "server_predicted_per_second": _server_rate(row, "predicted_n", "predicted_ms"),
                    "server_prompt_per_second": _server_rate(row, "prompt_n", "prompt_ms"),
                    "drafted": first.drafted, "accepted": first.accepted})
            results.append(result)
    classes: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        classes.setdefault((r["kind"], r["config"]), []).append(r)
    summary = []
    for (kind, config), members in classes.items():
        keys = ["tokens_per_second", "speedup_vs_plain", "paired_speedup_vs_plain", "decode_speedup_vs_plain",
                "decode_tokens_per_second", "speedup_vs_transformers_prompt_lookup"]
        keys += [k for k in ("tokens_per_second_vs_llama_server_plain", "server_predicted_per_second",
                             "server_prompt_per_second") if all(m.get(k) is not None for m in members)]
        summary.append({"kind": kind, "config": config,
                        **{f"median_{key}": round(statistics.median(r[key] for r in members), 3) for key in keys},
                        "worst_paired_speedup_vs_plain": min(r["paired_speedup_vs_plain"] for r in members),
                        "identical_share": round(sum(r["identical_to_plain"] for r in members) / len(members), 3),
                        "all_identical_to_plain": all(r["identical_to_plain"] for r in members)})
    slower = [f"{s['kind']}/{s['config']} {s['worst_paired_speedup_vs_plain']:.2f}x" for s in summary
              if s["config"] != HF_LOOKUP and not is_peer(s["config"])
              and s["worst_paired_speedup_vs_plain"] < NEVER_SLOWER]
    machine = {"device": str(settings["device"]), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "machine": platform.machine(),
               "load_average_at_report": [round(x, 2) for x in os.getloadavg()]}  # busy neighbours show here
    return {**settings, **machine, "results": results, "by_class": summary, "slower_than_plain": slower}


def format_table(data: dict) -> str:
    """Speedups end to end (prefill included) and for decoding alone (after each turn's first token); with
    llama-server rows, every row's tok/s against llama-server's plain and llama-server's own timings."""
    peer = any(is_peer(r["config"]) for r in data["results"])
    width = max([27] + [len(r["config"]) for r in data["results"]])
    header = (f"{'workload':26} {'config':{width}} {'tok/s':>6} {'dec t/s':>7} {'tok/fwd':>7} {'accept':>6} "
              f"{'vs plain':>8} {'dec vs plain':>12} {'vs hf-pld':>9}" + (f" {'vs llama':>8}" if peer else "")
              + " same")
    lines = []  # which kernels each side ran (CODESPEC_CPU=avx2 against an --cpu avx2 llama-server), then the table
    if "forward_plan" in data:
        lines.append(f"codespec: {data['forward_plan']} (CODESPEC_CPU={data.get('codespec_cpu', 'native')})")
    if peer and "llama_server" in data:
        lines.append(f"llama-server: built with {data['llama_server'].get('cpu_features', 'unknown')}")
    lines += [header, "-" * len(header)]
    for r in data["results"]:
        tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] else "-"
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        vs_llama = (f" {r['tokens_per_second_vs_llama_server_plain']:7.2f}x"
                    if "tokens_per_second_vs_llama_server_plain" in r else (f" {'-':>8}" if peer else ""))
        lines.append(f"{r['workload']:26} {r['config']:{width}} {r['tokens_per_second']:6.1f} "
                     f"{r['decode_tokens_per_second']:7.1f} {tpf:>7} {acc:>6} {r['speedup_vs_plain']:7.2f}x "
                     f"{r['decode_speedup_vs_plain']:11.2f}x {r['speedup_vs_transformers_prompt_lookup']:8.2f}x"
                     f"{vs_llama} {'yes' if r['identical_to_plain'] else 'NO'}")
    class_header = (f"{'class':12} {'config':{max(32, width)}} {'tok/s':>6} {'vs plain':>8} {'paired':>7} "
                    f"{'worst':>6} {'dec vs plain':>12} {'dec t/s':>7} {'vs hf-pld':>9}"
                    + (f" {'vs llama':>8}" if peer else "") + f" {'same':>5}")
    lines += ["", class_header, "-" * len(class_header)]
    for s in data["by_class"]:
        vs_llama = (f" {s['median_tokens_per_second_vs_llama_server_plain']:7.2f}x"
                    if "median_tokens_per_second_vs_llama_server_plain" in s else (f" {'-':>8}" if peer else ""))
        lines.append(f"{s['kind']:12} {s['config']:{max(32, width)}} {s['median_tokens_per_second']:6.1f} "
                     f"{s['median_speedup_vs_plain']:7.2f}x "
                     f"{s['median_paired_speedup_vs_plain']:6.2f}x {s['worst_paired_speedup_vs_plain']:5.2f}x "
                     f"{s['median_decode_speedup_vs_plain']:11.2f}x {s['median_decode_tokens_per_second']:7.1f} "
                     f"{s['median_speedup_vs_transformers_prompt_lookup']:8.2f}x{vs_llama} {s['identical_share']:5.0%}")
    if peer:
        lines += ["", "tok/s: generated tokens over wall time, prefill and (llama-server) HTTP included; "
                      "vs llama: tok/s over llama-server plain's; same: identical to plain greedy "
                      "(llama-server rows: to llama-server plain)",
                  "", f"{'workload':26} {'llama-server config':{width}} {'pred t/s':>8} {'prompt t/s':>10} "
                      f"{'drafted':>7} {'accepted':>8} {'same as its plain':>17} {'same as codespec':>16}"]
        lines.append("-" * len(lines[-1]))
        for r in data["results"]:
            if is_peer(r["config"]):
                lines.append(f"{r['workload']:26} {r['config']:{width}} {r['server_predicted_per_second'] or 0:8.1f} "
                             f"{r['server_prompt_per_second'] or 0:10.1f} {r['drafted'] or 0:7} {r['accepted'] or 0:8} "
                             f"{'yes' if r['identical_to_plain'] else 'NO':>17} "
                             f"{'yes' if r['identical_to_codespec_plain'] else 'NO':>16}")
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
