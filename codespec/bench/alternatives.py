"""Alternatives of one request (llama.cpp's n_cmpl, which llama.vscode sends as 3 with every completion), end to
end: /infill through the real HTTP server with n_cmpl 1 and 3, interleaved, on the bench's completion workloads cut
into a prefix and a suffix; greedy and sampled (temperature 0.8), with the prompt cached (a slot that served the
file before, as an editor's next keystroke finds it) and cold. Reported: median wall time of each, and 3's over 1's.
"""

from __future__ import annotations

import importlib
import inspect
import statistics
import time

from .predicted import serving
from .workloads import COMPLETIONS, stdlib_source

CASES = [(temperature, cached) for temperature in (0.0, 0.8) for cached in (True, False)]


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
    rows = []
    with serving(engine) as client:
        for name, body in fim_bodies():
            for temperature, cached in CASES:
                request = {**body, "temperature": temperature, "seed": 7, "cache_prompt": cached, "id_slot": 0}
                client.post("/infill", json={**request, "n_predict": 0})  # the slot holds the prompt (or a warm path)
                seconds = {1: [], 3: []}
                tokens = {1: 0, 3: 0}
                for _ in range(repeats):
                    for count in (1, 3):
                        started = time.perf_counter()
                        answer = client.post("/infill", json={**request, "n_cmpl": count})
                        seconds[count].append(time.perf_counter() - started)
                        answer.raise_for_status()
                        data = answer.json()
                        items = data if isinstance(data, list) else [data]
                        tokens[count] = sum(item["tokens_predicted"] for item in items)
                        if progress is not None:
                            progress.update()
                one, three = statistics.median(seconds[1]), statistics.median(seconds[3])
                rows.append({"workload": name, "temperature": temperature, "prompt_cached": cached,
                             "tokens_1": tokens[1], "tokens_3": tokens[3], "seconds_1": round(one, 3),
                             "seconds_3": round(three, 3), "ratio": round(three / one, 3),
                             "spread_1": [round(min(seconds[1]), 3), round(max(seconds[1]), 3)],
                             "spread_3": [round(min(seconds[3]), 3), round(max(seconds[3]), 3)]})
    return rows


def format_alternatives(rows: list[dict]) -> str:
    header = (f"{'workload':22} {'temp':>4} {'prompt':>6} {'tokens 1/3':>11} {'s, n_cmpl 1':>12} {'s, 3':>7} "
              f"{'3 / 1':>6}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['workload']:22} {r['temperature']:4.1f} {'cached' if r['prompt_cached'] else 'cold':>6} "
                     f"{r['tokens_1']:5}/{r['tokens_3']:<5} {r['seconds_1']:12.3f} {r['seconds_3']:7.3f} "
                     f"{r['ratio']:6.3f}")
    return "\n".join(lines)
