"""Alternatives of one request (llama.cpp's n_cmpl, which llama.vscode sends as 3 with every completion), end to
end: /infill through the real HTTP server with n_cmpl 1 and 3, interleaved, on the bench's completion workloads cut
into a prefix and a suffix; greedy and sampled (temperature 0.8), with the prompt cached (a slot that served the
file before, as an editor's next keystroke finds it) and cold. Reported: median wall time of each, 3's over 1's,
and 3's over its longest alternative run alone. The shared n-gram pool is emptied before every request, so that
no run drafts from what an earlier one wrote (the same seeds write the same text).
"""

from __future__ import annotations

import importlib
import inspect
import statistics
import time

from .predicted import serving
from .workloads import COMPLETIONS, stdlib_source

CASES = [(temperature, cached) for temperature in (0.0, 0.8) for cached in (True, False)]
SEED = 7  # n_cmpl 3's alternatives sample with seeds 7, 8 and 9 (Generations.start_all)


def fim_bodies() -> list[tuple[str, dict]]:
    """(name, /infill body) for each completion workload: cut halfway through its function."""
    bodies = []
    for module, qualname in COMPLETIONS:
        source = inspect.getsource(importlib.import_module(module))
        body = stdlib_source(module, qualname)
        cut = source.index(body.splitlines()[0].strip()) + len(body) // 2
        bodies.append((f"fim:{qualname.split('.')[-1]}", {
            "input_prefix": source[max(0, cut - 4000) : cut], "input_suffix": source[cut : cut + 1500],
            "prompt": "", "n_predict": 128, "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"]}))
    return bodies


def run_alternatives(engine, repeats: int, progress=None) -> list[dict]:
    """Each workload and case: n_cmpl 3 against one completion, interleaved. Sampled alternatives use seeds 7, 8
    and 9 and may run to different lengths, so one completion is also timed with each seed alone: n_cmpl 3 ends
    when its longest alternative does, and `ratio_vs_longest` compares it with that alternative alone."""
    rows = []
    with serving(engine) as client:
        for name, body in fim_bodies():
            for temperature, cached in CASES:
                request = {**body, "temperature": temperature, "seed": SEED, "cache_prompt": cached, "id_slot": 0}
                client.post("/infill", json={**request, "n_predict": 0})  # the slot holds the prompt (or a warm path)
                seeds = (SEED, SEED + 1, SEED + 2) if temperature else (SEED,)
                runs = [(1, seed) for seed in seeds] + [(3, SEED)]
                seconds: dict = {run: [] for run in runs}
                tokens: dict = {}
                for _ in range(repeats):
                    for count, seed in runs:
                        engine.shared.pool.reset()  # (each request drafts from an empty pool, not an earlier run's)
                        started = time.perf_counter()
                        answer = client.post("/infill", json={**request, "n_cmpl": count, "seed": seed})
                        seconds[(count, seed)].append(time.perf_counter() - started)
                        answer.raise_for_status()
                        data = answer.json()
                        tokens[(count, seed)] = sum(item["tokens_predicted"]
                                                    for item in (data if isinstance(data, list) else [data]))
                        if progress is not None:
                            progress.update()
                median = {run: statistics.median(times) for run, times in seconds.items()}
                one, three = median[(1, SEED)], median[(3, SEED)]
                longest = max(median[(1, seed)] for seed in seeds)
                rows.append({"workload": name, "temperature": temperature, "prompt_cached": cached,
                             "tokens_1": tokens[(1, SEED)], "tokens_3": tokens[(3, SEED)],
                             "tokens_alone": [tokens[(1, seed)] for seed in seeds],
                             "seconds_1": round(one, 3), "seconds_longest_alone": round(longest, 3),
                             "seconds_3": round(three, 3), "ratio": round(three / one, 3),
                             "ratio_vs_longest": round(three / longest, 3),
                             "spread_1": [round(min(seconds[(1, SEED)]), 3), round(max(seconds[(1, SEED)]), 3)],
                             "spread_3": [round(min(seconds[(3, SEED)]), 3), round(max(seconds[(3, SEED)]), 3)]})
    return rows


def format_alternatives(rows: list[dict]) -> str:
    header = (f"{'workload':22} {'temp':>4} {'prompt':>6} {'tokens 1/3':>11} {'s, n_cmpl 1':>12} {'longest alone':>13} "
              f"{'s, 3':>7} {'3 / 1':>6} {'3 / longest':>11}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['workload']:22} {r['temperature']:4.1f} {'cached' if r['prompt_cached'] else 'cold':>6} "
                     f"{r['tokens_1']:5}/{r['tokens_3']:<5} {r['seconds_1']:12.3f} {r['seconds_longest_alone']:13.3f} "
                     f"{r['seconds_3']:7.3f} {r['ratio']:6.3f} {r['ratio_vs_longest']:11.3f}")
    return "\n".join(lines)
