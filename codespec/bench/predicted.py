"""Predicted Outputs, end to end: edits through the real HTTP server (uvicorn, /v1/chat/completions), each without
speculation, with the default chain, and with the default chain and a `prediction`: the model's own answer (what
plain decoding wrote: an output that follows its prediction all the way), the original code, and another function's
code (a prediction that does not match).

Two kinds of edits: the bench's edit class (rewrite a function, changing one thing), and fast apply (a lazy edit,
`# ... existing code ...` around the changed lines, merged into the function). Reported per edit, medians of
interleaved rounds: completion tok/s over the whole request (prefill included) and over the generation alone
(llama.cpp's predicted_per_second), tokens per forward, the prediction's accepted and rejected tokens, and whether
the text equals plain decoding's.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from contextlib import contextmanager

import httpx

from ..config import ServerConfig
from ..errors import CodespecError
from .workloads import EDITS, edit_request, stdlib_source

FAST_APPLY = [  # (module, function, a changed line the lazy edit shows, the line it replaces)
    ("heapq", "nlargest", "    # Short-cut for n==1 is to use max() (the common case)",
     "    # Short-cut for n==1 is to use max()"),
    ("textwrap", "TextWrapper._split", "    chunks = [c for c in chunks if c]  # no empty chunks",
     "    chunks = [c for c in chunks if c]"),
]
CONFIGS = ("plain", "default chain", "its own text", "the original", "a wrong one")  # (the prediction's)


def chosen(names: str | None) -> tuple[str, ...]:
    """The configurations --predictions names (comma-separated; None: all), in CONFIGS' order, the default chain
    always among them (the ratios' base); "its own text" needs "plain" (its prediction is plain's answer)."""
    if names is None:
        return CONFIGS
    wanted = {name.strip() for name in names.split(",") if name.strip()} | {"default chain"}
    if unknown := wanted - set(CONFIGS):
        raise CodespecError(f"--predictions: unknown {', '.join(sorted(unknown))} (choose from {', '.join(CONFIGS)})")
    if "its own text" in wanted:
        wanted.add("plain")
    return tuple(config for config in CONFIGS if config in wanted)


def fast_apply_request(module: str, qualname: str, new_line: str, old_line: str) -> tuple[str, str]:
    """A lazy edit of a function and the function: the chat message and the prediction (the original)."""
    source = stdlib_source(module, qualname)
    if old_line not in source:
        raise ValueError(f"{module}.{qualname} has no line {old_line!r}")
    edit = f"# ... existing code ...\n{new_line}\n# ... existing code ..."
    message = (f"Apply this edit to the function below. Reply with the complete updated function only.\n\n"
               f"Edit:\n```python\n{edit}\n```\n\nFunction:\n```python\n{source}```")
    return message, source


def workloads() -> list[tuple[str, str, str]]:
    """(name, chat message, prediction: the code the answer is expected to repeat)."""
    rows = [(f"edit:{qualname.split('.')[-1]}", edit_request(module, qualname, change),
             stdlib_source(module, qualname)) for module, qualname, change in EDITS]
    rows += [(f"apply:{qualname.split('.')[-1]}", *fast_apply_request(module, qualname, new, old))
             for module, qualname, new, old in FAST_APPLY]
    return rows


@contextmanager
def serving(engine):
    """The engine behind the real app, on uvicorn in a thread, at a loopback port."""
    import uvicorn

    from ..server import create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerConfig(slots=1)), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(30)


def one(client: httpx.Client, message: str, max_tokens: int, plain: bool = False, prediction: str | None = None
        ) -> dict:
    body = {"messages": [{"role": "user", "content": message}], "max_tokens": max_tokens, "temperature": 0,
            "cache_prompt": False}
    if plain:
        body["spec"] = "none"
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    started = time.perf_counter()
    answer = client.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - started
    answer.raise_for_status()
    data = answer.json()
    tokens = data["usage"]["completion_tokens"]
    return {"text": data["choices"][0]["message"]["content"], "tokens": tokens, "seconds": seconds,
            "end_to_end": tokens / seconds, "decode": data["timings"]["predicted_per_second"],
            "tokens_per_forward": data["speculation"]["tokens_per_forward"],
            **data["usage"]["completion_tokens_details"]}


def run_predicted(engine, max_tokens: int, repeats: int, progress=None, configs: tuple = CONFIGS) -> list[dict]:
    """Every workload in each of `configs` (chosen's), `repeats` interleaved rounds, each round in the reverse order of
    the one before: one row per (workload, config), with the median of its paired ratios to the default chain's
    decode tok/s (round by round: the host's drift cancels)."""
    work = workloads()
    rows = []
    with serving(engine) as client:
        for index, (name, message, prediction) in enumerate(work):
            wrong = work[(index + 1) % len(work)][2]  # another function's code
            runs = {config: [] for config in configs}
            one(client, message, 8, plain=True)  # warm the path (plain: teaches the pool nothing)
            for round_ in range(repeats):
                for config in configs if round_ % 2 == 0 else configs[::-1]:
                    engine.shared.pool.reset()  # no run drafts from what an earlier one taught the shared pool
                    predicted = {"its own text": runs["plain"][0]["text"] if runs.get("plain") else None,
                                 "the original": prediction, "a wrong one": wrong}.get(config)
                    runs[config].append(one(client, message, max_tokens, config == "plain", predicted))
                    if progress is not None:
                        progress.update()
            plain_text = runs["plain" if "plain" in runs else "default chain"][0]["text"]
            base = {key: statistics.median(r[key] for r in runs["default chain"]) for key in ("end_to_end", "decode")}
            for config, results in runs.items():
                median = {key: statistics.median(r[key] for r in results)
                          for key in ("end_to_end", "decode", "tokens_per_forward", "accepted_prediction_tokens",
                                      "rejected_prediction_tokens")}
                rows.append({"workload": name, "config": config, "tokens": results[0]["tokens"],
                             **{key: round(value, 2) for key, value in median.items()},
                             "decode_spread": [round(min(r["decode"] for r in results), 1),
                                               round(max(r["decode"] for r in results), 1)],
                             "decode_vs_default_chain": round(median["decode"] / base["decode"], 3),
                             "paired_vs_default_chain": round(statistics.median(
                                 r["decode"] / c["decode"] for r, c in zip(results, runs["default chain"])), 3),
                             "end_to_end_vs_default_chain": round(median["end_to_end"] / base["end_to_end"], 3),
                             "identical_to_plain": all(r["text"] == plain_text for r in results)})
    return rows


def format_predicted(rows: list[dict]) -> str:
    header = (f"{'workload':22} {'config':17} {'tokens':>6} {'e2e tok/s':>9} {'decode':>7} {'spread':>13} "
              f"{'tok/fwd':>7} {'acc':>4} {'rej':>4} {'vs chain':>8} {'paired':>6} same")
    lines = [header, "-" * len(header)]
    for r in rows:
        spread = f"{r['decode_spread'][0]}-{r['decode_spread'][1]}"
        lines.append(f"{r['workload']:22} {r['config']:17} {r['tokens']:6} {r['end_to_end']:9.1f} {r['decode']:7.1f} "
                     f"{spread:>13} {r['tokens_per_forward']:7.2f} {r['accepted_prediction_tokens']:4.0f} "
                     f"{r['rejected_prediction_tokens']:4.0f} {r['decode_vs_default_chain']:8.3f} "
                     f"{r['paired_vs_default_chain']:6.3f} "
                     f"{'yes' if r['identical_to_plain'] else 'NO'}")
    return "\n".join(lines)
