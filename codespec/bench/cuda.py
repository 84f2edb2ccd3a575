"""The GPU bench: what a forward costs on CUDA against its floors, whether speculation stays lossless there, and
edits against the transformers peers on the same GPU.

    python -m codespec.bench.cuda --out DIR [--sections forward,identity,edits] [--model M]

- forward: ms per forward over 1-32 rows on 256 cached tokens for the lean forward (PyTorch kernels one by one),
  the graph-safe forward without graphs, and with CUDA graphs (graphs.py); kernels per forward (CUDA profiler); the
  launch floor (kernels x the measured cost of one launch); the memory floor (weights and the cache a forward
  reads, over the measured device-to-device bandwidth). The model's weights do not change what a forward costs:
  `--random` runs this section on a randomly initialised model of the same shape.
- identity: greedy speculative output (codespec's default chain) against plain decoding of the same engine, on
  the bench's workloads and on `--fuzz` generated prompts (stdlib source at random places, and random tokens), in
  float32 and bfloat16.
- edits: tokens per second on the bench's edit and completion workloads: codespec's default chain and its plain
  decoding, transformers' `generate` (eager, with its static cache and torch.compile, and with prompt lookup).
Each section writes DIR/<section>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

SIZES = (1, 2, 4, 8, 16, 32)


def synchronized_ms(run, repeats: int = 30) -> float:
    """Median ms of run() with the device drained before and after each call."""
    times = []
    for _ in range(repeats + 3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[3:]) * 1e3


def launch_us(count: int = 3000) -> float:
    """Microseconds per kernel launched back to back from Python (a one-element add)."""
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(count):
        x.add_(1)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / count * 1e6


def copy_bandwidth(megabytes: int = 1024) -> float:
    """Bytes per second a device-to-device copy moves, counting what it reads and what it writes."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = synchronized_ms(lambda: target.copy_(source), repeats=10)
    return 2 * source.numel() / (ms / 1e3)


def device_events(run) -> list:
    """The profiler's GPU events of one call of run() (after one call to warm up; a CUDA graph's replay shows the
    kernels inside it)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def kernels(run) -> int:
    """CUDA kernels one call of run() launches (copies and fills aside)."""
    return sum(1 for event in device_events(run)
               if "memcpy" not in event.name.lower() and "memset" not in event.name.lower())


def kernel_profile(run, top: int = 12) -> list[dict]:
    """Where one call of run() spends the GPU's time: the kernels that take most, with their count per call."""
    totals: dict[str, list] = {}
    for event in device_events(run):
        entry = totals.setdefault(event.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time_total
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [{"kernel": name, "count": count, "us": round(us, 1)} for name, (count, us) in ranked]


def forward_section(model, compiled: bool = True) -> dict:
    from ..forward import LeanLlama, Rows
    from ..forward.graphs import GraphLlama
    from .forward_costs import weight_bytes

    context = int(model.config.max_position_embeddings)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (256 + max(SIZES),)).tolist()
    weights = weight_bytes(model)
    bandwidth, launch = copy_bandwidth(), launch_us()
    lean = LeanLlama(model)
    paths = {"lean (kernel by kernel)": lean,
             "graph-safe, no graphs": GraphLlama(lean, context, graphs=False, compiled=False),
             "graph-safe, CUDA graphs": GraphLlama(lean, context, compiled=False),
             **({"graph-safe, compiled, CUDA graphs": GraphLlama(lean, context, compiled=True)} if compiled else {}),
             "graph-safe, CUDA graphs, --ctx-size 2048": GraphLlama(lean, min(context, 2048), compiled=False)}
    rows = []
    for name, path in paths.items():
        cache = path.new_cache()
        path(cache, ids[:256], 1)
        row = {"path": name, "ms": {}, "kernels": {}}
        for size in SIZES:
            batch = [Rows(cache, ids[256 : 256 + size], size, generating=True)]

            def forward():
                path.batch(batch)
                cache.crop(256)

            try:
                row["ms"][size] = round(synchronized_ms(forward), 3)
                row["kernels"][size] = kernels(forward)
            except Exception as error:  # a path that cannot run here: say so in the table
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                break
        if name == "graph-safe, no graphs" and "error" not in row:  # the kernels a replay runs, timed one by one
            row["profile_k16"] = kernel_profile(lambda: (path.batch([Rows(cache, ids[256:272], 16)]), cache.crop(256)))
        cache_read = getattr(path, "cache_bytes", lambda: 0)()  # the graph-safe forward reads its whole cache
        row["memory_floor_ms"] = round((weights + cache_read) / (bandwidth / 2) * 1e3, 3)
        row["launch_floor_ms"] = {size: round(count * launch / 1e3, 3) for size, count in row["kernels"].items()}
        rows.append(row)
    return {"device": torch.cuda.get_device_name(), "dtype": str(model.dtype).removeprefix("torch."),
            "weights_mb": round(weights / 1e6, 1), "copy_bandwidth_gb_s": round(bandwidth / 1e9),
            "launch_us": round(launch, 2), "context": context, "rows": rows}


def format_forward(data: dict) -> str:
    """forward_section's table: ms per forward over k rows, kernels per forward and the floors."""
    lines = [f"one forward over k rows on {data['device']}, {data['dtype']}, ms (a launch {data['launch_us']} us, "
             f"copies {data['copy_bandwidth_gb_s']} GB/s, weights {data['weights_mb']} MB)"]
    header = (f"{'path':40} " + " ".join(f"{'k=' + str(k):>7}" for k in SIZES)
              + f" {'kernels':>8} {'launch':>7} {'memory':>7}")
    lines += [header, "-" * len(header)]
    for row in data["rows"]:
        ms, kernels, launch = ({int(k): v for k, v in row[key].items()} for key in ("ms", "kernels", "launch_floor_ms"))
        times = " ".join(f"{ms[k]:7.2f}" if k in ms else f"{'-':>7}" for k in SIZES)
        lines.append(f"{row['path']:40} {times} {kernels.get(1, 0):8d} {launch.get(1, 0):7.2f} "
                     f"{row['memory_floor_ms']:7.2f}" + (f"  ({row['error']})" if "error" in row else ""))
    for row in data["rows"]:
        if row.get("profile_k16"):
            total = sum(entry["us"] for entry in row["profile_k16"])
            lines.append(f"{row['path']}, k=16, the GPU's busiest kernels ({total:.0f} us of them in one forward):")
            lines += [f"  {entry['us']:8.1f} us  x{entry['count']:<4d} {entry['kernel']}" for entry in row["profile_k16"]]
    lines.append("kernels, launch and memory at k=1. launch: the kernels of one forward at the measured cost of one "
                 "launch; memory: the weights and the cache it reads at the copy bandwidth (the graph-safe forward "
                 "reads its whole cache)")
    return "\n".join(lines)


def fuzz_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Half stdlib source from a random place (code repeats: drafts get accepted), half random tokens."""
    import inspect
    import json as json_module
    import textwrap

    rng = np.random.default_rng(seed)
    sources = [inspect.getsource(module) for module in (textwrap, json_module.decoder, inspect)]
    prompts = []
    for index in range(count):
        length = int(rng.integers(8, 400))
        if index % 2 == 0:
            text = sources[index % len(sources)]
            start = int(rng.integers(0, len(text) - 4 * length))
            prompts.append(tokenizer(text[start : start + 4 * length]).input_ids[:length])
        else:
            prompts.append(rng.integers(1, tokenizer.vocab_size, length).tolist())
    return prompts


def identity_section(model_name: str, dtypes: list[str], fuzz: int, max_tokens: int) -> dict:
    from ..config import ModelConfig, SamplingParams, SpecConfig
    from ..engine import Engine
    from .runner import turn_prompt
    from .workloads import all_workloads

    results = {}
    for dtype in dtypes:
        engine = Engine.load(ModelConfig(model=model_name, device="cuda", dtype=dtype), show_progress=False)
        prompts = [turn_prompt(engine, w, [{"role": "user", "content": w.turns[0]}], w.turns[0])
                   for w in all_workloads(1)]
        prompts += fuzz_prompts(engine.tokenizer, fuzz)
        params = SamplingParams(max_tokens=max_tokens)
        same, drafted, accepted, forwards, tokens, first_difference = 0, 0, 0, 0, 0, []
        for index, prompt in enumerate(prompts):
            plain = engine.generate(prompt, params, spec=SpecConfig(spec=("none",)))
            fast = engine.generate(prompt, params)
            if fast.tokens == plain.tokens:
                same += 1
            else:
                first_difference.append(next((i for i, (a, b) in enumerate(zip(fast.tokens, plain.tokens)) if a != b),
                                             min(len(fast.tokens), len(plain.tokens))))
            drafted, accepted = drafted + fast.stats.drafted_tokens, accepted + fast.stats.accepted_tokens
            forwards, tokens = forwards + fast.stats.target_forwards, tokens + len(fast.tokens)
        results[dtype] = {"prompts": len(prompts), "identical": same, "first_difference_at": first_difference,
                          "drafted": drafted, "accepted": accepted,
                          "tokens_per_forward": round(tokens / max(forwards, 1), 2),
                          "path": type(engine.path).__name__, "reads": getattr(engine.path, "reads", "")}
        print(f"{dtype}: {same}/{len(prompts)} identical, {accepted}/{drafted} draft tokens accepted, "
              f"{results[dtype]['tokens_per_forward']} tokens per forward", flush=True)
        del engine
        torch.cuda.empty_cache()
    return results


def edits_section(model_name: str, repeats: int, max_tokens: int, per_class: int, configs: str = "all") -> dict:
    from ..config import ModelConfig
    from ..engine import Engine
    from .runner import (DEFAULT_CHAIN, DRAFT_QUARTER, HF_LOOKUP, PLAIN, Config, build_configs, format_table, report,
                         run_bench)
    from .workloads import completion_workloads, edit_workloads

    engine = Engine.load(ModelConfig(model=model_name, device="cuda"), show_progress=False)
    layers = engine.model.config.num_hidden_layers
    base = {c.name: c for c in build_configs(False, engine.spec.draft_max, engine.spec, layers)}
    if configs == "draft":  # codespec's draft model (the target's first quarter) beside plain and the default
        chosen = [base[PLAIN], base[DEFAULT_CHAIN], base[DRAFT_QUARTER], base[HF_LOOKUP]]
    else:
        chosen = [base[PLAIN], base[DEFAULT_CHAIN], base[HF_LOOKUP], Config("transformers generate", hf_options={}),
                  Config("transformers static cache + compile", hf_options={"cache_implementation": "static"})]
    workloads = edit_workloads(per_class) + completion_workloads(per_class)
    rows = run_bench(engine, workloads, chosen, repeats, max_tokens)
    data = report(rows, {"device": torch.cuda.get_device_name(), "dtype": str(engine.model.dtype),
                         "path": type(engine.path).__name__, "max_tokens": max_tokens, "repeats": repeats})
    print(format_table(data), flush=True)
    return data


def random_model(model_name: str, dtype: torch.dtype):
    """A randomly initialised model of the named model's shape, on the GPU (what a forward costs does not depend
    on the weights' values)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..forward.models import pull

    local = Path(model_name)  # a folder with the model's config.json is enough
    config = AutoConfig.from_pretrained(str(local if (local / "config.json").exists()
                                            else pull(model_name, show_progress=False)))
    return AutoModelForCausalLM.from_config(config).to("cuda", dtype).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codespec.bench.cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sections", default="forward,identity,edits")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="identity: the dtypes to check")
    parser.add_argument("--no-compile", action="store_true", help="forward: leave out the torch.compile row")
    parser.add_argument("--random", action="store_true", help="forward: a random model of the same shape")
    parser.add_argument("--fuzz", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-class", type=int, default=1)
    parser.add_argument("--configs", default="all", help="edits: all (codespec and transformers' peers) or draft "
                        "(plain, the default chain and a draft model)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("codespec.bench.cuda: no CUDA device here", file=sys.stderr)
        return 1
    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    if "forward" in sections:
        for dtype in (torch.float32, torch.bfloat16):
            if args.random:
                model = random_model(args.model, dtype)
            else:
                from ..config import ModelConfig
                from ..forward.models import load

                model, _ = load(ModelConfig(model=args.model, device="cuda", dtype=str(dtype).removeprefix("torch.")),
                                show_progress=False)
            data = forward_section(model, compiled=not args.no_compile)
            print(format_forward(data), flush=True)
            (out / f"forward-{data['dtype']}.json").write_text(json.dumps(data, indent=1))
            del model
    if "identity" in sections:
        data = identity_section(args.model, args.dtypes.split(","), args.fuzz, args.max_tokens)
        (out / "identity.json").write_text(json.dumps(data, indent=1))
    if "edits" in sections:
        data = edits_section(args.model, args.repeats, 256, args.per_class, args.configs)
        name = "edits.json" if args.configs == "all" else f"edits-{args.configs}.json"
        (out / name).write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
