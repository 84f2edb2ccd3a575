"""`codespec bench`: its options and what it runs (the workloads and runner are in this package)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..cli.types import MODEL_FLAGS, bounded_int
from ..config import DEFAULT_MODEL, DRAFT_MAX_LIMIT, ModelConfig, SpecConfig
from ..errors import CodespecError


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """`codespec bench`'s own options (the model options come from codespec/cli/options.py)."""
    bench.add_argument("--quick", action="store_true",
                       help="one workload per class, 3 turns, 48 tokens, 4 configurations, once (< 3 min on 2 cores)")
    bench.add_argument("--per-class", type=bounded_int(1, 5), default=2, help="workloads per class")
    bench.add_argument("--classes", default="edit,completion,multi-turn,free-form,prose",
                       help="comma-separated workload classes to run")
    bench.add_argument("--configs", help="comma-separated configurations to run (default: all; plain and "
                                         "'transformers prompt lookup' always run, as the baselines)")
    bench.add_argument("--repeats", type=bounded_int(1, 50), default=3, help="runs per configuration (median)")
    bench.add_argument("--max-tokens", type=bounded_int(1, 4096), default=256, help="new tokens per turn")
    bench.add_argument("--draft-max", type=bounded_int(1, DRAFT_MAX_LIMIT), default=SpecConfig().draft_max)
    bench.add_argument("--never-slower", action="store_true",
                       help="the never-slower lane: every drafter and the default chain against plain at each of "
                            "--lengths, --repeats paired interleaved rounds, spread reported, anything under 0.97x "
                            "named (writes never-slower.json)")
    bench.add_argument("--lengths", default="32,128,512", metavar="N,N",
                       help="tokens per generation in the never-slower lane (default 32,128,512)")
    bench.add_argument("--two-session", action="store_true",
                       help="session A rewrites a file, then session B rewrites it: the shared pool at work")
    bench.add_argument("--predicted", action="store_true",
                       help="Predicted Outputs through the HTTP server: each edit plain, with the default chain, and "
                            "with the chain and a prediction: the model's own answer, the original code, another "
                            "function's (writes predicted.json)")
    bench.add_argument("--predictions", metavar="CONFIGS",
                       help="the --predicted configurations to run, comma-separated, the default chain always among "
                            "them (default: plain,default chain,its own text,the original,a wrong one)")
    bench.add_argument("--alternatives", action="store_true",
                       help="n_cmpl through the HTTP server: /infill with 1 and 3 alternatives on the completion "
                            "workloads, greedy and sampled, prompt cached and cold (writes alternatives.json)")
    bench.add_argument("--forward-costs", action="store_true",
                       help="only time one forward over k = 1..64 tokens per forward path, next to the machine's "
                            "floor, with a profile (a full run includes this)")
    bench.add_argument("--no-forward-costs", action="store_true",
                       help="leave the forward-cost table out of a full run (saves about two minutes)")
    bench.add_argument("--out", default="bench-results", help="folder for bench.json and bench.png")
    bench.add_argument("--llama-server", metavar="PATH",
                       help="also run llama.cpp's llama-server (this binary) on the same GGUF and prompts, side by "
                            "side: plain, and its n-gram speculation at its defaults and at draft-max 16 (build one "
                            "with python -m codespec.bench.build_llama_server --out DIR)")
    bench.add_argument("--llama-server-threads", type=bounded_int(1, 1024), metavar="N",
                       help="llama-server's -t/-tb (default: torch's thread count, codespec's own)")
    bench.add_argument("--zoo", metavar="SHAPES",
                       help="the model zoo: random-weight GGUFs at these published shapes (comma-separated, or 'all': "
                            "qwen2.5-coder-0.5b, -1.5b, -3b, -7b, llama-3.2-1b, smollm2-1.7b), quantized by "
                            "llama-quantize into --zoo-types, each measured in codespec and llama-server side by side: "
                            "load s, peak RSS, forward ms at k = 1/4/16 and its floor, prefill and decode tok/s "
                            "(needs --llama-server; writes zoo.json)")
    bench.add_argument("--zoo-types", default="Q8_0,Q4_K_M,Q5_K_M,Q6_K,Q4_0", metavar="TYPES",
                       help="the quantizations the zoo makes (default Q8_0,Q4_K_M,Q5_K_M,Q6_K,Q4_0)")
    bench.add_argument("--zoo-dir", default="zoo-models", metavar="DIR",
                       help="where the zoo keeps its F16 files (one per shape, reused) and, for a row, its quantized one")
    bench.add_argument("--llama-server-spec-types", default="ngram-simple,ngram-mod", metavar="TYPES",
                       help="llama-server's n-gram --spec-type values to run (default ngram-simple,ngram-mod; also "
                            "ngram-map-k, ngram-map-k4v, ngram-cache)")


def run_zoo(args) -> int:
    """`codespec bench --zoo`: bench/zoo.py."""
    from pathlib import Path

    import torch

    from . import zoo

    shapes = list(zoo.SHAPES) if args.zoo == "all" else [name.strip() for name in args.zoo.split(",") if name.strip()]
    kinds = [kind.strip() for kind in args.zoo_types.split(",") if kind.strip()]
    rows = zoo.run(shapes, kinds, Path(args.zoo_dir), Path(args.llama_server) if args.llama_server else None,
                   args.llama_server_threads or torch.get_num_threads())
    print(zoo.format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "zoo.json").write_text(json.dumps(rows, indent=2))
    return 0


def run(args) -> int:
    """`codespec bench`: the lanes its flags ask for, or the full bench."""
    import contextlib
    from pathlib import Path

    from tqdm.auto import tqdm

    from ..engine import Engine
    from . import runner
    from .workloads import all_workloads

    if args.zoo:
        return run_zoo(args)
    quick = args.quick
    repeats, max_tokens, turns = (1, 48, 3) if quick else (args.repeats, args.max_tokens, 5)
    classes = {name.strip() for name in args.classes.split(",") if name.strip()}
    try:
        lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1 or max(lengths) > 4096:
        raise CodespecError(f"--lengths takes token counts from 1 to 4096, like 32,128,512; got {args.lengths!r}")
    workloads = [w for w in all_workloads(1 if quick else args.per_class) if w.kind in classes]
    known = [c.name for c in runner.build_configs(quick, args.draft_max, SpecConfig())]
    wanted = set(known)
    if args.configs:
        wanted = {name.strip() for name in args.configs.split(",")} | {runner.PLAIN, runner.HF_LOOKUP}
        unknown = wanted - set(known)
        if unknown:
            raise CodespecError(f"unknown bench config {', '.join(sorted(unknown))}; choose from {', '.join(known)}")
    if not workloads:
        raise CodespecError(f"no workload in classes {args.classes!r}; use edit, completion, multi-turn, free-form, prose")
    peer = None
    if args.llama_server:  # checked before the model loads, so a wrong path is a one-line error at once
        import torch

        from .llama_server import Peer, check_binary, gguf_for

        check_binary(args.llama_server)  # before the GGUF is looked for
        peer = Peer(args.llama_server, gguf_for(args.model),
                    args.llama_server_threads or torch.get_num_threads(),
                    [t.strip() for t in args.llama_server_spec_types.split(",") if t.strip()])
    engine = Engine.load(ModelConfig(**{name: getattr(args, name) for name in MODEL_FLAGS
                                        if getattr(args, name) is not None}))
    print(f"codespec: {engine.plan}", flush=True)
    # the verify-cost table now (read, or measured where none is kept: after any change to the forward's code), not
    # inside the first speculative run's time (5 s of one of the two runs of a requantized model's edit)
    print(f"codespec: verify costs {json.dumps(engine.costs.to_dict())}", flush=True)  # (CODESPEC_COSTS's shape)
    configs = [c for c in runner.build_configs(quick, args.draft_max, SpecConfig(draft_max=args.draft_max),
                                               engine.model.config.num_hidden_layers) if c.name in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.two_session:
        from .two_session import CONFIGS, format_rows, run_two_session

        with tqdm(total=2 * len(CONFIGS), desc="two-session", unit="run") as progress:
            rows = run_two_session(engine, args.max_tokens, progress=progress)
        print(format_rows(rows))
        (out / "two-session.json").write_text(json.dumps({"two_session": rows, "max_tokens": args.max_tokens},
                                                         indent=2))
        return 0
    if args.alternatives:
        from .alternatives import CASES, fim_bodies, format_alternatives, run_alternatives

        runs = sum(4 if temperature else 2 for temperature, _ in CASES) * len(fim_bodies()) * repeats
        with tqdm(total=runs, desc="alternatives", unit="run") as progress:
            rows = run_alternatives(engine, repeats, progress=progress)
        print(format_alternatives(rows))
        (out / "alternatives.json").write_text(json.dumps({"alternatives": rows}, indent=2))
        return 0
    if args.predicted:
        from .predicted import chosen, format_predicted, run_predicted, workloads

        configs = chosen(args.predictions)
        with tqdm(total=len(workloads()) * len(configs) * repeats, desc="predicted", unit="run") as progress:
            rows = run_predicted(engine, max_tokens, repeats, progress=progress, configs=configs)
        print(format_predicted(rows))
        (out / "predicted.json").write_text(json.dumps({"predicted": rows, "max_tokens": max_tokens}, indent=2))
        return 0
    if args.never_slower:
        from .never_slower import format_lane, rounds, run_lane

        lane = [c for c in configs if c.spec is not None and c.name != runner.FIXED_CHAIN]  # plain among them
        runs = len(workloads) * (len(lane) + 1) * sum(rounds(repeats, n) for n in lengths)
        with tqdm(total=runs, desc="never slower", unit="run") as bar:
            data = run_lane(engine, workloads, lane, lengths, repeats, progress=bar)
        print(format_lane(data))
        (out / "never-slower.json").write_text(json.dumps(data, indent=2))
        return 0
    forward = None
    if args.forward_costs and engine.model.device.type == "cuda":  # a GPU's floors and forwards (bench/cuda.py)
        from .cuda import forward_section, format_forward

        forward = forward_section(engine.model)
        print(format_forward(forward))
        (out / "forward.json").write_text(json.dumps(forward, indent=2))
        return 0
    if args.forward_costs or not (quick or args.no_forward_costs):
        from .forward_costs import forward_costs, format_forward_costs, outside_forward_share

        from ..forward.models import gguf_source

        try:
            source = engine.gguf or gguf_source(args.model or DEFAULT_MODEL)
        except CodespecError:  # no GGUF behind this model: no row for its blocks
            source = None
        base = engine.model
        if engine.gguf is not None:  # its weights are the GGUF's values now: the other rows need the checkpoint's
            from ..forward.models import load

            base, _ = load(ModelConfig(weights="checkpoint", **{name: getattr(args, name) for name in (
                "model", "device", "dtype") if getattr(args, name) is not None}), show_progress=False)
        from ..forward import q8_available

        with tqdm(total=(6 + q8_available() if source else 5), desc="forward costs", unit="step") as progress:
            forward = forward_costs(base, base.config.vocab_size, progress, gguf=source)
            edits = [w for w in all_workloads(1) if w.kind == "edit"]
            forward["outside_forwards_at_draft_max_64"] = outside_forward_share(engine, edits[0], max_tokens)
            progress.update()
        print(format_forward_costs(forward))
        if args.forward_costs:
            (out / "forward.json").write_text(json.dumps(forward, indent=2))
            return 0
    settings = {"device": engine.model.device, "dtype": str(engine.model.dtype).removeprefix("torch."),
                "weights": "gguf" if engine.gguf else "checkpoint", "forward_plan": str(engine.plan),
                "codespec_cpu": os.environ.get("CODESPEC_CPU", "native"),
                "max_tokens": max_tokens, "repeats": repeats, "turns": turns, "quick": quick}
    with peer if peer is not None else contextlib.nullcontext():  # llama-server processes stop on the way out
        if peer is not None:
            configs += [runner.Config(name, server=server) for name, server in peer.servers.items()]
            settings["llama_server"] = peer.describe()
        with tqdm(total=len(workloads) * len(configs) * repeats, desc="bench", unit="run") as progress:
            rows = runner.run_bench(engine, workloads, configs, repeats, max_tokens, turns, progress)
    data = runner.report(rows, settings)
    if forward is not None:
        data["forward"] = forward
    print(runner.format_table(data))
    (out / "bench.json").write_text(json.dumps(data, indent=2))
    runner.plot(data, str(out / "bench.png"))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}", file=sys.stderr)
    return 0
