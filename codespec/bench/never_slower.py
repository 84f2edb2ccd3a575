"""The never-slower lane: every drafter and the default chain against plain decoding, on every class, at several
generation lengths, in paired, interleaved runs, so that a 3% loss stands out from the machine's noise.

Each round runs every configuration once on a workload, one configuration later each round (runner.run_bench), and
a configuration's paired ratio for the round is plain's time over its own in that round: runs side by side share the
machine's state. The lane reports, per class, configuration and length, the median of those ratios over rounds and
workloads and their spread (the lowest and highest, and the interquartile range), the time outside forwards, and
whether every output matched plain's; and it names every configuration whose median falls under NEVER_SLOWER, after
measuring each such row again with more rounds beside plain alone (recheck): its verdict is the recheck's median.

Two things let a reader judge a row against the machine's noise. Plain runs twice a round, and the second copy's
row (PLAIN_AGAIN, plain against itself) is the noise floor: on a shared 2-core machine single runs of the same work
differ by up to 1.5x. Short generations get more rounds (their runs are short and noisier, and cheap), so a cell
costs about the same at every length. Next to the median, "best" compares each side's fastest run: load on the
machine only ever adds time, so the fastest runs are the least disturbed. And the forward's cost curve bounds what
any drafter can win on this CPU: k tokens per forward at best, for the cost of a forward over k rows.
"""

from __future__ import annotations

import statistics

from ..engine import Engine
from . import runner
from .workloads import Workload

LENGTHS = (32, 128, 512)  # tokens generated: an editor's completion, an edit's worth, a long answer
PLAIN_AGAIN = "plain (again)"  # plain against itself: the noise floor
MORE_ROUNDS = 256  # lengths under this run repeats * (MORE_ROUNDS // length) rounds, at most 4x
RECHECK_REPEATS = 6  # a row under NEVER_SLOWER runs again alone with plain: this many rounds' worth (rounds())


def rounds(repeats: int, length: int) -> int:
    return repeats * max(1, min(4, MORE_ROUNDS // length))


def ceiling(costs) -> dict:
    """The most a drafter can win on this CPU: a forward over k rows yields k tokens when every draft is accepted,
    against k one-token forwards (the cost table measured for the adaptive choice)."""
    one = costs.cost(1)
    bounds = {k: k * one / costs.cost(k) for k in (2, 4, 8, 16)}
    best = max(bounds, key=bounds.get)
    return {"ms": {k: round(costs.cost(k) * 1e3, 2) for k in (1, *bounds)}, "best_k": best,
            "speedup": round(bounds[best], 3)}


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles (the values themselves when there are fewer than four)."""
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def recheck(engine: Engine, workloads: list[Workload], configs: list[runner.Config], result: dict, repeats: int,
            progress=None) -> dict:
    """A row under NEVER_SLOWER, measured again with more rounds and only plain and plain again beside it (fewer
    configurations a round: the rounds sit closer in time): its median paired ratio and spread, and plain against
    itself in the same rounds."""
    length = result["max_tokens"]
    chosen = [w for w in workloads if w.kind == result["kind"]]
    trio = [c for c in configs if c.name in (runner.PLAIN, result["config"], PLAIN_AGAIN)]
    rows = runner.run_bench(engine, chosen, trio, rounds(repeats, length), length, turns=1, progress=progress)
    plain = {row.workload.name: row for row in rows if row.config == runner.PLAIN}

    def ratios(config: str) -> list[float]:
        return [p.seconds / r.seconds for row in rows if row.config == config
                for p, r in zip(plain[row.workload.name].runs, row.runs)]

    mine, noise = ratios(result["config"]), ratios(PLAIN_AGAIN)
    low, high = quartiles(mine)
    return {"runs": len(mine), "median": round(statistics.median(mine), 3), "q1": round(low, 3),
            "q3": round(high, 3), "plain_again": round(statistics.median(noise), 3)}


def verdict(result: dict) -> float:
    """A row's median paired ratio: the recheck's where it was rechecked."""
    return result["recheck"]["median"] if "recheck" in result else result["median_paired_speedup_vs_plain"]


def run_lane(engine: Engine, workloads: list[Workload], configs: list[runner.Config], lengths=LENGTHS,
             repeats: int = 5, progress=None, repeats_recheck: int = RECHECK_REPEATS) -> dict:
    """Every configuration (plain among them, and plain again) on every workload at every length, paired rounds:
    `repeats` at the longest lengths, more at short ones (rounds()). A row under NEVER_SLOWER is measured again
    (recheck), and its verdict is the recheck's median."""
    plain = next(c for c in configs if c.name == runner.PLAIN)
    configs = [*configs, runner.Config(PLAIN_AGAIN, plain.spec)]
    rows = []
    for length in lengths:
        for row in runner.run_bench(engine, workloads, configs, rounds(repeats, length), length, turns=1,
                                    progress=progress):
            rows.append((length, row))
    plain = {(length, row.workload.name): row for length, row in rows if row.config == runner.PLAIN}
    groups: dict[tuple[str, str, int], dict] = {}
    for length, row in rows:
        if row.config == runner.PLAIN:
            continue
        base = plain[(length, row.workload.name)]
        group = groups.setdefault((row.workload.kind, row.config, length),
                                  {"ratios": [], "outside": [], "identical": True, "tokens_per_forward": [],
                                   "best": []})
        group["ratios"] += [p.seconds / r.seconds for p, r in zip(base.runs, row.runs)]
        group["best"].append(min(p.seconds for p in base.runs) / min(r.seconds for r in row.runs))
        group["outside"] += [r.outside_forwards / r.seconds for r in row.runs if r.seconds > 0]
        group["identical"] &= all(r.tokens == base.runs[0].tokens for r in row.runs)
        first = row.runs[0]
        if first.forwards:
            group["tokens_per_forward"].append(len(first.tokens) / first.forwards)
    results = []
    for (kind, config, length), group in groups.items():
        ratios = group["ratios"]
        low, high = quartiles(ratios)
        results.append({
            "kind": kind, "config": config, "max_tokens": length, "runs": len(ratios),
            "median_paired_speedup_vs_plain": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3), "max": round(max(ratios), 3),
            "q1": round(low, 3), "q3": round(high, 3), "best": round(statistics.median(group["best"]), 3),
            "tokens_per_forward": round(statistics.median(group["tokens_per_forward"]), 2)
            if group["tokens_per_forward"] else None,
            "outside_forwards_share": round(statistics.median(group["outside"]), 4) if group["outside"] else None,
            "identical_to_plain": group["identical"]})
    flagged = [r for r in results
               if r["median_paired_speedup_vs_plain"] < runner.NEVER_SLOWER and r["config"] != PLAIN_AGAIN]
    for result in flagged:
        result["recheck"] = recheck(engine, workloads, configs, result, repeats_recheck, progress)
    slower = [f"{r['kind']}/{r['config']}@{r['max_tokens']} {verdict(r):.3f}x" for r in flagged
              if verdict(r) < runner.NEVER_SLOWER]
    noise = [r for r in results if r["config"] == PLAIN_AGAIN]
    return {"lengths": list(lengths), "repeats": repeats, "rounds": {n: rounds(repeats, n) for n in lengths},
            "workloads": [w.name for w in workloads], "never_slower": runner.NEVER_SLOWER,
            "ceiling": ceiling(engine.costs), "results": results, "slower_than_plain": slower,
            "noise_floor": {"lowest_median": min(r["median_paired_speedup_vs_plain"] for r in noise),
                            "highest_median": max(r["median_paired_speedup_vs_plain"] for r in noise)}}


def format_lane(data: dict) -> str:
    width = max([24] + [len(r["config"]) for r in data["results"]])
    header = (f"{'class':11} {'config':{width}} {'tokens':>6} {'paired':>7} {'spread (min..max, IQR)':>28} "
              f"{'best':>6} {'tok/fwd':>7} {'outside':>7} same")
    rounds_ = ", ".join(f"{n} at {length} tokens" for length, n in data["rounds"].items())
    top = data["ceiling"]
    lines = [f"never slower: median of paired rounds per workload ({rounds_}; {', '.join(data['workloads'])})",
             "forward ms at k = " + ", ".join(f"{k}: {ms}" for k, ms in top["ms"].items())
             + f"; with every draft accepted a drafter wins at most {top['speedup']:.2f}x here (k = {top['best_k']})",
             header, "-" * len(header)]
    for r in sorted(data["results"], key=lambda r: (r["kind"], r["config"], r["max_tokens"])):
        spread = f"{r['min']:.2f}..{r['max']:.2f}, {r['q1']:.2f}..{r['q3']:.2f}"
        tpf = f"{r['tokens_per_forward']:.2f}" if r["tokens_per_forward"] else "-"
        outside = f"{r['outside_forwards_share']:.1%}" if r["outside_forwards_share"] is not None else "-"
        flag = " <" if r["median_paired_speedup_vs_plain"] < data["never_slower"] else ""
        if "recheck" in r:
            again = r["recheck"]
            flag += (f" rechecked: {again['median']:.3f}x over {again['runs']} rounds (IQR {again['q1']:.2f}.."
                     f"{again['q3']:.2f}; plain again {again['plain_again']:.3f}x)")
        lines.append(f"{r['kind']:11} {r['config']:{width}} {r['max_tokens']:6} "
                     f"{r['median_paired_speedup_vs_plain']:6.3f}x {spread:>28} {r['best']:5.3f}x {tpf:>7} {outside:>7} "
                     f"{'yes' if r['identical_to_plain'] else 'NO'}{flag}")
    slower = data["slower_than_plain"]
    noise = data["noise_floor"]
    lines += ["", f"noise floor: {PLAIN_AGAIN} against plain, medians {noise['lowest_median']:.3f}x.."
                  f"{noise['highest_median']:.3f}x",
              f"under {data['never_slower']}x of plain (median of paired runs, rechecked): "
              f"{', '.join(slower) if slower else 'none'}"]
    return "\n".join(lines)
