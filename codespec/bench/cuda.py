"""The GPU bench: what a forward costs on CUDA against its floors, whether speculation stays lossless there, and
edits against the transformers peers on the same GPU.

    python -m codespec.bench.cuda --out DIR [--sections forward,identity,edits,sessions] [--model M] [--shapes S]
        [--device cuda] [--random]

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
- sessions: the graph-safe forward with several sessions' rows stacked in one forward (a tick of B sessions, one
  graph replay per bucket B in the path's buckets, 1, 2, 4, 8, 16), for each of `--ops` (torch: PyTorch's kernels;
  triton: the fused Triton kernels, CUDA only): ms per forward of B sessions x 16 rows (k=16, verifying drafts) and
  B sessions x 1 row (k=1), each session on `--cached` tokens (256) of its own; rows per second and that against
  one session's forward (B x its ms over the stacked forward's); kernels per forward (CUDA profiler, null
  elsewhere); the launch floor (kernels x one launch) and the memory floor (the weights plus the B sessions' whole
  cache slots, as the forward section counts; `memory_floor_filled_ms` counts only their filled positions, which
  is what attention reading the filled part alone would read), and each time over its floor.
  `--session-dtypes` (float32,bfloat16) says in which dtypes; `--random` as for forward.
- shapes (`--shapes smollm2,qwen2.5-coder-1.5b,llama-3.2-3b,qwen2.5-coder-7b`; any of SHAPES: zoo.py's published
  shapes, the default model's, Llama 3.2 3B's and `tiny` for the tests): the forward of random-weight models of
  those shapes (a transformers config from the shape, built on the device in `--shape-dtype`, bfloat16, with its
  random init: no download, no float32 copy on the host), graph-safe with graphs on CUDA, ms at k=1 and k=16 on
  `--cached` tokens with its memory floor (weights and the cache slot) and the time over it, per `--ops`.
  The floors count the model's weights, as the forward section does; `forward_weights_mb` beside them is what the
  graph-safe forward multiplies (its head in float32 for a 16-bit model, no embedding table).
Each section writes DIR/<section>[-<dtype>].json and prints a table.

`--device` (cuda by default) runs the sessions and shapes sections elsewhere too, for their plumbing: on a CPU
(`python -m codespec.bench.cuda --out DIR --device cpu --sections sessions --random --model tiny --shapes tiny`)
times come from time.perf_counter without a device to wait for, and kernels and the launch floor are null.

On a GPU (issue 41's figures: no download, random weights at the models' shapes; one prepared command from the
repository root, about 10 minutes at most, each step under its own timeout so that a slow one leaves the others
their time; the device tool's $OUT, or bench-results/cuda):

    set -o pipefail; export PYTHONUNBUFFERED=1; O=${OUT:-bench-results/cuda}; mkdir -p $O
    timeout 270 python3 -m codespec.bench.cuda --out $O --sections sessions --random --model smollm2 \
        --session-dtypes float32,bfloat16 2>&1 | tee $O/sessions.txt
    timeout 210 python3 -m codespec.bench.cuda --out $O --sections shapes \
        --shapes smollm2,qwen2.5-coder-1.5b,llama-3.2-3b,qwen2.5-coder-7b 2>&1 | tee $O/shapes.txt
    CODESPEC_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/unit/test_graphs.py \
        tests/unit/test_bench_cuda_plumbing.py 2>&1 | tail -20 | tee $O/tests-cuda.txt

(--ops is torch,triton on CUDA by default; it writes sessions-float32.json, sessions-bfloat16.json and
shapes-bfloat16.json beside the three logs.) Where the default model and `codespec serve`'s packages are installed
(pip install -e .; the device machines here have neither), the server under load, every concurrent session's text
checked against one client's (codespec.bench.server_load):

    python -m codespec.bench.server_load --phases throughput --require-identity --out $O/server-load-cuda.json \
        -- --device cuda
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import sys
from pathlib import Path

import numpy as np
import torch

from .cuda_device import (device_name, is_cuda, kernel_profile, kernels,
                          synchronized_ms)
from ..forward.graphs import GraphLlama
from .cuda_sessions import (CACHED, SHAPES, floors, format_sessions, format_shapes,
                            round_or_none, sessions_section, shape_model, shapes_section)

SIZES = (1, 2, 4, 8, 16, 32)
def forward_section(model, compiled: bool = True) -> dict:
    from ..forward import LeanLlama, Rows
    from .forward_costs import weight_bytes

    device = model.device
    context = int(model.config.max_position_embeddings)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (256 + max(SIZES),)).tolist()
    weights = weight_bytes(model)
    bandwidth, launch = floors(device)
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
                row["ms"][size] = round(synchronized_ms(forward, device=device), 3)
                row["kernels"][size] = kernels(forward, device)
            except Exception as error:  # a path that cannot run here: say so in the table
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                break
        if name == "graph-safe, no graphs" and "error" not in row and is_cuda(device):  # a replay's kernels, one by one
            row["profile_k16"] = kernel_profile(lambda: (path.batch([Rows(cache, ids[256:272], 16)]), cache.crop(256)))
        cache_read = getattr(path, "cache_bytes", lambda: 0)()  # the graph-safe forward reads its whole cache
        row["memory_floor_ms"] = round((weights + cache_read) / (bandwidth / 2) * 1e3, 3)
        row["launch_floor_ms"] = {size: round_or_none(None if count is None else count * launch / 1e3)
                                  for size, count in row["kernels"].items()}
        rows.append(row)
    return {"device": device_name(device), "dtype": str(model.dtype).removeprefix("torch."),
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
        count, floor = kernels.get(1), launch.get(1)
        lines.append(f"{row['path']:40} {times} {'-' if count is None else count:>8} "
                     f"{'-' if floor is None else f'{floor:.2f}':>7} "
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


def random_model(model_name: str, dtype: torch.dtype, device="cuda"):
    """A randomly initialised model of the named model's shape, made on the device in `dtype` (what a forward costs
    does not depend on the weights' values): a name in SHAPES needs nothing downloaded; else the model's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..forward.models import pull

    if model_name in SHAPES:
        return shape_model(SHAPES[model_name], device, dtype)
    local = Path(model_name)  # a folder with the model's config.json is enough
    config = AutoConfig.from_pretrained(str(local if (local / "config.json").exists()
                                            else pull(model_name, show_progress=False)))
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def section_model(args, dtype: torch.dtype):
    """The model the forward and sessions sections run: random weights of --model's shape (--random), or its own."""
    if args.random:
        return random_model(args.model, dtype, args.device)
    from ..config import ModelConfig
    from ..forward.models import load

    model, _ = load(ModelConfig(model=args.model, device=args.device, dtype=str(dtype).removeprefix("torch.")),
                    show_progress=False)
    return model


def names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codespec.bench.cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sections", default="forward,identity,edits",
                        help="forward, identity, edits, sessions (comma-separated); --shapes adds shapes")
    parser.add_argument("--device", default="cuda", help="forward, sessions, shapes: the device (cuda; cpu runs "
                        "their plumbing: perf_counter times, no kernel counts)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="identity: the dtypes to check")
    parser.add_argument("--no-compile", action="store_true", help="forward: leave out the torch.compile row")
    parser.add_argument("--random", action="store_true", help="forward, sessions: a random model of the same shape "
                        "(a name in SHAPES needs no download)")
    parser.add_argument("--ops", default=None, help="sessions, shapes: the graph-safe forward's operations, "
                        "comma-separated (torch, triton; default: torch,triton on CUDA, torch elsewhere)")
    parser.add_argument("--session-dtypes", default="float32,bfloat16", help="sessions: the dtypes to run")
    parser.add_argument("--cached", type=int, default=CACHED, help="sessions, shapes: tokens each session holds")
    parser.add_argument("--timed", type=int, default=30, help="forward timings per median (sessions, shapes)")
    parser.add_argument("--shapes", default="", help="random-weight models of these shapes (comma-separated: "
                        f"{', '.join(SHAPES)}), one session's forward at k=1 and k=16 against its memory floor")
    parser.add_argument("--shape-dtype", default="bfloat16", help="shapes: the models' dtype")
    parser.add_argument("--fuzz", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-class", type=int, default=1)
    parser.add_argument("--configs", default="all", help="edits: all (codespec and transformers' peers) or draft "
                        "(plain, the default chain and a draft model)")
    args = parser.parse_args(argv)
    sections = names(args.sections)
    if args.shapes and "shapes" not in sections:
        sections.append("shapes")
    if "shapes" in sections and not names(args.shapes):
        parser.error(f"the shapes section needs --shapes (of {', '.join(SHAPES)})")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("codespec.bench.cuda: no CUDA device here (--device cpu runs the forward, sessions and shapes "
              "sections' plumbing)", file=sys.stderr)
        return 1
    if device.type != "cuda" and {"identity", "edits"} & set(sections):
        print("codespec.bench.cuda: identity and edits run on CUDA only", file=sys.stderr)
        return 1
    ops = names(args.ops) if args.ops else (["torch", "triton"] if device.type == "cuda" else ["torch"])
    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = floors(device) if {"sessions", "shapes"} & set(sections) else None
    if "forward" in sections:
        for dtype in (torch.float32, torch.bfloat16):
            model = section_model(args, dtype)
            data = forward_section(model, compiled=not args.no_compile)
            print(format_forward(data), flush=True)
            (out / f"forward-{data['dtype']}.json").write_text(json.dumps(data, indent=1))
            del model
    if "sessions" in sections:
        for dtype in names(args.session_dtypes):
            model = section_model(args, getattr(torch, dtype))
            data = sessions_section(model, ops, args.cached, args.timed, measured)
            print(format_sessions(data), flush=True)
            (out / f"sessions-{data['dtype']}.json").write_text(json.dumps(data, indent=1))
            del model
            gc.collect()
    if "shapes" in sections:
        written = out / f"shapes-{args.shape_dtype}.json"
        data = shapes_section(names(args.shapes), device, getattr(torch, args.shape_dtype), ops, args.cached,
                              args.timed, measured, lambda so_far: written.write_text(json.dumps(so_far, indent=1)))
        print(format_shapes(data), flush=True)
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
