"""One target forward: ms over k tokens for each forward path, next to the machine's floor, and where the
time goes. Decoding a small model is memory-bound: a forward must read every weight once, so the floor is
weight bytes / read bandwidth (measured here, not assumed)."""

from __future__ import annotations

import copy
import statistics
import time

import torch

from ..adaptive import measure_costs
from ..forward import FEW_ROWS, LeanLlama, Rows, TransformersForward, q8_available

SIZES = (1, 2, 4, 8, 16, 32, 64)
CATEGORIES = (
    ("weight matmuls", ("mkldnn::_linear_pointwise", "aten::linear", "aten::mm", "aten::addmm", "aten::matmul")),
    ("attention", ("aten::bmm", "aten::_softmax", "aten::softmax", "aten::scaled_dot_product_attention",
                   "codespec::cached_attention")),
)


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second one pass over a buffer much larger than the caches reads (the best of repeats)."""
    buffer = torch.ones(megabytes << 18, dtype=torch.float32)  # megabytes MB of float32
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights count once


def profile(path, vocab_size: int, tokens: int, context: int = 256, forwards: int = 5) -> dict:
    """Shares of one forward's wall time: weight matmuls, attention, other kernels, and the rest (the
    interpreter, dispatch and waiting between kernels)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cache = path.new_cache()
    path(cache, [i % vocab_size for i in range(context)], 1)
    ids = [(7 * i) % vocab_size for i in range(tokens)]
    path(cache, ids, tokens)
    cache.crop(context)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(forwards):
            path(cache, ids, tokens)
            cache.crop(context)
        wall = time.perf_counter() - started
    spent = {name: 0.0 for name, _ in CATEGORIES}
    spent["other kernels"] = 0.0
    for event in prof.key_averages():
        category = next((name for name, ops in CATEGORIES if event.key in ops), "other kernels")
        spent[category] += event.self_cpu_time_total / 1e6
    spent["numba, python, gaps"] = max(0.0, wall - sum(spent.values()))
    return {"tokens": tokens, "ms_per_forward_profiled": round(wall / forwards * 1e3, 2),
            "shares": {name: round(seconds / wall, 3) for name, seconds in spent.items()}}


PREFILL_TOKENS = 700  # an edit prompt's size (the bench's edit class: ~660 tokens)


def prefill_rates(path, vocab_size: int, tokens: int = PREFILL_TOKENS, repeats: int = 3) -> dict:
    """Prompt tokens per second caching a cold prompt, in one forward and in the server's 128-token chunks, with
    prompt chunks multiplied in float32 and in bfloat16 (--prompt-precision), or with q8 activations (whose
    kernels take prompts too); medians of `repeats`."""
    ids = torch.randint(0, vocab_size, (tokens,)).tolist()
    rates = {}
    for precision in ("q8 activations",) if path.q8 else ("float32", "bfloat16"):
        path.use_prompt_precision("float32" if path.q8 else precision)
        for chunk in (tokens, 128):
            seconds = []
            for _ in range(repeats + 1):  # the first warms up
                cache, started = path.new_cache(), time.perf_counter()
                for start in range(0, tokens, chunk):
                    path.batch([Rows(cache, ids[start : start + chunk], 1, prompt=True)])
                seconds.append(time.perf_counter() - started)
            rates[f"{precision}, chunks of {chunk}"] = round(tokens / statistics.median(seconds[1:]))
    path.use_prompt_precision("float32")
    return rates


def forward_costs(model, vocab_size: int, progress=None, gguf=None) -> dict:
    """`gguf`: the file the model came from, for a row on its own blocks (--weights gguf)."""
    bandwidth = read_bandwidth()
    fp32_bytes = weight_bytes(model) * 4 // model.dtype.itemsize
    lean, wide = LeanLlama(model), LeanLlama(model)
    wide.kernel_weights = None
    paths = [("lean float32", lean, lean.kernel_weights.nbytes if lean.kernel_weights else fp32_bytes),
             ("lean, PyTorch only", wide, fp32_bytes), ("transformers float32", TransformersForward(model), fp32_bytes)]
    if gguf is not None:
        blocks = LeanLlama(copy.deepcopy(model), gguf=gguf, activations="float32")
        paths.insert(1, ("lean, --weights gguf", blocks, blocks.kernel_weights.nbytes))
        if q8_available():
            blocks = LeanLlama(copy.deepcopy(model), gguf=gguf, activations="q8")
            paths.insert(1, ("gguf, q8 activations", blocks, blocks.kernel_weights.nbytes))
    if model.device.type == "cpu" or torch.cuda.is_bf16_supported():
        half = copy.deepcopy(model).to(torch.bfloat16)
        paths.append(("lean bfloat16", LeanLlama(half), fp32_bytes // 2))
    rows = []
    for name, path, size in paths:
        costs = measure_costs(path, vocab_size, sizes=SIZES, repeats=3)
        rows.append({"path": name, "read_mb": float(f"{size / 1e6:.4g}"),
                     "floor_ms": float(f"{size / bandwidth * 1e3:.3g}"),  # significant figures: a tiny model's is µs
                     "ms": {k: round(s * 1e3, 2) for k, s in zip(costs.sizes, costs.seconds)}})
        if progress is not None:
            progress.update()
    prefill_paths = [path for name, path, _ in paths if name in ("lean, --weights gguf", "gguf, q8 activations")]
    prefill = {}
    for path in (prefill_paths or [lean]) if model.device.type == "cpu" else []:
        prefill.update(prefill_rates(path, vocab_size))
    return {"read_bandwidth_gb_s": round(bandwidth / 1e9, 2), "weight_mb_float32": round(fp32_bytes / 1e6, 1),
            "reads_16_bits_up_to": FEW_ROWS if lean.kernel_weights else 0,
            "prefill_tok_s": prefill,
            "rows": rows, "profile": [profile(lean, vocab_size, k) for k in (1, 16)]}


def outside_forward_share(engine, workload, max_tokens: int) -> float:
    """The share of generation time outside target forwards (drafting, bookkeeping, cache handling) with the
    default chain verifying drafts of up to 64 tokens, adaptive length off: the most drafting per step."""
    from ..config import SpecConfig
    from .runner import Config, run_workload

    spec = SpecConfig(draft_max=64, adaptive=False)
    run = run_workload(engine, workload, Config("draft-max 64", spec), max_tokens, turns=1)
    return round(run.outside_forwards / run.seconds, 4)


def format_forward_costs(data: dict) -> str:
    lines = [f"one forward over k tokens, ms (read bandwidth {data['read_bandwidth_gb_s']} GB/s, "
             f"weights {data['weight_mb_float32']} MB in float32)"]
    header = f"{'path':22} {'floor':>6} " + " ".join(f"{'k=' + str(k):>7}" for k in SIZES)
    lines += [header, "-" * len(header)]
    for row in data["rows"]:
        lines.append(f"{row['path']:22} {row['floor_ms']:6.1f} " + " ".join(f"{row['ms'][k]:7.1f}" for k in SIZES))
    if data.get("reads_16_bits_up_to"):
        lines.append(f"lean float32 runs forwards up to k={data['reads_16_bits_up_to']} in numba, reading its "
                     "bfloat16-valued weights as 16 bits (its floor is for those); PyTorch over 32 bits beyond")
    if any(row["path"] == "lean, --weights gguf" for row in data["rows"]):
        lines.append("lean, --weights gguf reads the GGUF's blocks in numba up to the same k (its floor is "
                     "for those), PyTorch over their values as float32 beyond")
    if any(row["path"] == "gguf, q8 activations" for row in data["rows"]):
        lines.append("gguf, q8 activations (the default on x86 CPUs with AVX2 or AVX512-VNNI) runs every k in numba: "
                     "the blocks times activations rounded to 8 bits, exact integer sums (its floor: the blocks, "
                     "float16 scales)")
    for entry in data["profile"]:
        shares = ", ".join(f"{name} {share:.0%}" for name, share in entry["shares"].items())
        lines.append(f"lean float32, k={entry['tokens']} ({entry['ms_per_forward_profiled']} ms profiled): {shares}")
    if data.get("prefill_tok_s"):
        rates = ", ".join(f"{name} {rate}" for name, rate in data["prefill_tok_s"].items())
        lines.append(f"prefill of a {PREFILL_TOKENS}-token prompt, tok/s (--prompt-precision): {rates}")
    if "outside_forwards_at_draft_max_64" in data:
        lines.append(f"time outside target forwards at draft-max 64: {data['outside_forwards_at_draft_max_64']:.1%}")
    return "\n".join(lines)
