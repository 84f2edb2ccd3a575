"""llama.vim against a real `codespec serve`: what its users wait for. Run `python -m codespec.bench.llama_vim`.

The requests are llama.vim's own (autoload/llama.vim, newest): its local context (n_prefix 256 lines before the
cursor, n_suffix 64 after), `id_slot` 0, n_predict 128, t_max_predict_ms 250 for a first request, `samplers`,
`response_fields`. At each of --positions cursor positions in a real file (the standard library's textwrap.py,
past line 256 so the window slides), the user has just pressed Enter: the cursor sits on a new empty line.

- shown: the first request at that position (what the ghost text waits for);
- after accept: llama.vim's speculative request, which it sends as soon as a suggestion is shown, for the context
  "as if the suggestion were accepted" (the window slides down by the suggestion's lines; its `prev` argument).
  Its answer is what appears after Tab, so its latency and how much of its prompt the server's cache already held
  (tokens_cached / prompt tokens) are the figures that matter;
- instruct: `:LlamaInstruct` on a 20-line selection, its messages as llama.vim builds them (the selection with 256
  lines before and 64 after in the system message): the `n_predict: 0` warm-up, sent when the instruction prompt
  opens, then the streamed instruction on Enter, 0, 0.5, 1 or 2 s later or once the warm-up is done; the time from
  Enter to the first streamed text. Cold (slot 1, nothing of it cached), then right after a FIM suggestion on an
  empty line inside the selection, in slot 0 (llama.vim's first instruction) and slot 1 (its second).

Each --cache-reuse value runs on its own fresh server (0: prefix reuse only; 256: llama-server users' setting).
"""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap
import threading
import time
from pathlib import Path

from .server_load import percentile, serve

N_PREFIX, N_SUFFIX = 256, 64
FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/predicted_n", "timings/predicted_ms",
          "truncated", "tokens_cached"]


def fim_body(lines: list[str], y: int, prev: list[str] | None, t_max_predict_ms: int) -> dict:
    """llama.vim's s:fim_ctx_local for a cursor on the empty line y (0-based), optionally as if `prev` (the shown
    suggestion's lines) were accepted there, and its request."""
    if not prev:
        prefix_lines, middle = lines[max(0, y - N_PREFIX) : y], ""
    else:
        line_cur = prev[0] if len(prev) == 1 else prev[-1]
        prefix_lines = lines[max(0, y - N_PREFIX + len(prev) - 1) : y]
        if len(prev) > 1:
            prefix_lines = prefix_lines + [prev[0]] + prev[1:-1]
        middle = line_cur
    suffix_lines = lines[y + 1 : y + 1 + N_SUFFIX]
    return {"id_slot": 0, "input_prefix": "\n".join(prefix_lines) + "\n", "input_suffix": "\n" + "\n".join(
        suffix_lines) + "\n", "input_extra": [], "prompt": middle, "n_predict": 128, "stop": [], "n_indent": 0,
        "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
        "t_max_prompt_ms": 500, "t_max_predict_ms": t_max_predict_ms, "response_fields": FIELDS}


def post(client, body: dict) -> dict:
    started = time.perf_counter()
    response = client.post("/infill", json=body)
    response.raise_for_status()
    answer = response.json()
    cached = answer.get("tokens_cached", 0)
    computed = answer.get("timings/prompt_n", 0)
    return {"seconds": time.perf_counter() - started, "content": answer.get("content", ""),
            "reused": cached / max(cached + computed, 1), "prompt_tokens": cached + computed,
            "prompt_ms": answer.get("timings/prompt_ms"), "predicted_n": answer.get("timings/predicted_n"),
            "predicted_ms": answer.get("timings/predicted_ms")}


def suggestion_lines(content: str) -> list[str]:
    parts = content.split("\n")
    while parts and parts[-1] == "":
        parts.pop()
    return parts


INSTRUCTION_SYSTEM = (  # llama#inst_build's system message, then the context, prefix, selection and suffix
    "You are a text-editing assistant. Respond ONLY with the result of applying INSTRUCTION to SELECTION given the "
    "CONTEXT. Maintain the existing text indentation. Do not add extra code blocks. Respond only with the modified "
    "block. If the INSTRUCTION is a question, answer it directly. Do not output any extra separators. Consider the "
    "local context before (PREFIX) and after (SUFFIX) the SELECTION.\n")
TYPING_SECONDS = (0.0, 0.5, 1.0, 2.0, None)  # how long the instruction takes to type after the warm-up is sent
# (0.5 s: a one-word instruction by a fast typist; 0: Enter at the instant the prompt opens, a bound no person
# reaches); None: the warm-up has finished (a slow typist)
AFTER_FIM_TYPING_SECONDS = (0.0, 1.0, 2.0)  # the same right after a FIM suggestion inside the selection


def instruction_messages(lines: list[str], l0: int, l1: int, extra: list[dict], instruction: str) -> list[dict]:
    """llama#inst_build (1-based, inclusive selection). `join(l:extra, "\\n")` joins Vim dictionaries, which Vim
    writes as their string() form."""
    prefix = lines[max(1, l0 - N_PREFIX) - 1 : l0 - 1]
    selection = lines[l0 - 1 : l1]
    suffix = lines[l1 : min(len(lines), l1 + N_SUFFIX)]
    context = "\n".join("{" + ", ".join(f"'{key}': {value!r}" for key, value in chunk.items()) + "}"
                        for chunk in extra)
    dashes = "-" * 40
    system = (INSTRUCTION_SYSTEM + "\n"
              + f"--- CONTEXT     {dashes}\n" + context + "\n"
              + f"--- PREFIX      {dashes}\n" + "\n".join(prefix) + "\n"
              + f"--- SELECTION   {dashes}\n" + "\n".join(selection) + "\n"
              + f"--- SUFFIX      {dashes}\n" + "\n".join(suffix) + "\n")
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"INSTRUCTION: {instruction}" if instruction else ""}]


def clear_slot(client, slot: int) -> None:
    """The slot's cache holds a one-token prompt afterwards: what the next request finds there is cold."""
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "-"}], "id_slot": slot,
                                              "n_predict": 0})


def instruct(client, lines: list[str], typing: float | None, slot: int = 1, after_fim: bool = False) -> float:
    """Seconds from sending :LlamaInstruct's instruction to its first streamed text. llama.vim sends the warm-up
    (`n_predict: 0`) when its instruction prompt opens, and the instruction on Enter, `typing` seconds later, to
    slot `slot` (llama.vim's first instruction goes to slot 0, its FIM slot, the next to 1, 2, ...). after_fim:
    a FIM suggestion was asked for on an empty line inside the selection first (slot 0), as while editing there:
    the FIM slot holds most of the instruction's lines."""
    if after_fim:
        lines = lines[:310] + [""] + lines[310:]
        post(client, fim_body(lines, 310, None, 250))
    messages = instruction_messages(lines, 301, 320, [], "Add type hints.")  # a 20-line selection
    warm_up = threading.Thread(target=lambda: client.post("/v1/chat/completions", json={
        "messages": instruction_messages(lines, 301, 320, [], ""), "id_slot": slot, "n_predict": 0}))
    warm_up.start()
    if typing is None:
        warm_up.join()
    else:
        time.sleep(typing)
    started = time.perf_counter()
    try:
        with client.stream("POST", "/v1/chat/completions",
                           json={"messages": messages, "id_slot": slot, "stream": True, "n_predict": 64}) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
                    if delta:
                        return time.perf_counter() - started
        return float("nan")
    finally:
        warm_up.join()
        for used in {0, slot}:  # the slots move on: the next run starts cold
            clear_slot(client, used)


def run(client, positions: int) -> dict:
    source = Path(textwrap.__file__).read_text().splitlines()
    rows = []
    candidates = [y for y in range(N_PREFIX + 20, len(source) - 20) if source[y - 1].strip()]
    for y in candidates[:: max(1, len(candidates) // positions)][:positions]:
        lines = source[:y] + [""] + source[y:]  # Enter pressed after line y - 1
        shown = post(client, fim_body(lines, y, None, 250))
        prev = suggestion_lines(shown["content"])
        if not prev:
            continue
        after = post(client, fim_body(lines, y, prev, 1000))
        rows.append({"line": y, "shown_s": shown["seconds"], "after_s": after["seconds"], "after_reused": after["reused"],
                     "prompt_tokens": after["prompt_tokens"], "first": shown["content"][:40],
                     **{f"after_{key}": after[key] for key in ("prompt_ms", "predicted_n", "predicted_ms")}})
    for slot in (0, 1):  # nothing of the instruction cached: the FIM runs above left their prompts in slot 0
        clear_slot(client, slot)
    first_text = {"after warm-up" if typing is None else f"{typing:g} s typing":
                  instruct(client, source, typing) for typing in TYPING_SECONDS}
    for typing in AFTER_FIM_TYPING_SECONDS:  # as while editing there
        first_text[f"{typing:g} s typing, after FIM"] = instruct(client, source, typing, 1, after_fim=True)
    first_text["0 s typing, after FIM, slot 0"] = instruct(client, source, 0.0, 0, after_fim=True)
    return {"rows": rows, "instruct_first_text_s": first_text}


def summary(result: dict) -> dict:
    rows = result["rows"]
    after = [r["after_s"] for r in rows]
    return {"positions": len(rows), "shown_p50_s": statistics.median(r["shown_s"] for r in rows),
            "after_accept_p50_s": statistics.median(after), "after_accept_p95_s": percentile(after, 0.95),
            "after_accept_reused_median": statistics.median(r["after_reused"] for r in rows),
            "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rows),
            "instruct_first_text_s": result["instruct_first_text_s"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=8)
    parser.add_argument("--cache-reuse", default="0,256", help="values to compare, comma-separated")
    parser.add_argument("--url", help="measure this server instead of starting one per value")
    parser.add_argument("--output", type=Path, help="write the rows as JSON")
    parser.add_argument("serve_args", nargs="*",
                        help="extra `codespec serve` arguments (after --), e.g. --weights gguf")
    args = parser.parse_args(argv)
    report = {"serve_args": args.serve_args}
    for value in args.cache_reuse.split(","):
        with serve(args.url, ["--cache-reuse", value, *args.serve_args]) as client:
            result = run(client, args.positions)
        report[value] = {"summary": summary(result), **result}
        print(f"--cache-reuse {value}: " + json.dumps(report[value]["summary"]), flush=True)
        for row in result["rows"]:
            print(f"  line {row['line']}: shown {row['shown_s']:.2f}s, after accept {row['after_s']:.2f}s "
                  f"({row['after_reused']:.0%} of {row['prompt_tokens']} reused; prompt {row['after_prompt_ms']:.0f} ms, "
                  f"{row['after_predicted_n']} tokens in {row['after_predicted_ms']:.0f} ms) first: {row['first']!r}")
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
