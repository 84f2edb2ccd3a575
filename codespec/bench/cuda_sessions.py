"""The GPU bench's sessions and shapes sections (python -m codespec.bench.cuda --sections sessions,shapes; see
cuda.py's docstring for the command lines):

- sessions: B sessions' rows stacked in one graph-safe forward (graphs.py's buckets), per choice of operations
  (PyTorch's, Triton's): ms at k=1 and k=16, rows per second against one session's forward, kernels per forward
  and the launch and memory floors;
- shapes: one session's forward of random-weight models at real shapes (made on the device in their dtype), against
  its memory floor."""

from __future__ import annotations

import gc
import sys

import numpy as np
import torch

from ..forward.graphs import GraphLlama
from .cuda_device import copy_bandwidth, device_name, is_cuda, kernels, launch_us, synchronized_ms
from .zoo import SHAPES as ZOO_SHAPES
from .zoo import Shape

SESSION_ROWS = (1, 16)  # rows per session of the sessions and shapes sections: one token, and a whole width
BUCKETS = (1, 2, 4, 8, 16)  # sessions per stacked forward, where the path does not say (graphs.py's buckets)
CACHED = 256  # tokens each session holds before the timed forwards

# zoo.py's published shapes (its --zoo runs them all), and the few more the sessions and shapes sections take
SHAPES = {
    **ZOO_SHAPES,
    # SmolLM2-135M-Instruct, the default model (its config.json; rope_theta 100000)
    "smollm2": Shape("llama", 576, 1536, 30, 9, 3, 49152, True, 100000.0),
    # Llama-3.2-3B's published config.json (context: zoo's 8192 for the cache, not its 131072)
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128256, True, 500000.0),
    "tiny": Shape("llama", 64, 128, 2, 4, 2, 384, False, context=512),  # the tests' plumbing runs
}


def graph_lean(model):
    """The lean forward's weights as the graph-safe forward takes them (forward.lean.build's settings)."""
    from ..forward import LeanLlama

    return LeanLlama(model, cache_type="f32", prompt_precision="float32")


def path_weight_bytes(path) -> int:
    """Bytes of the weights a graph-safe forward multiplies: its layers' tensors and its head (float32 for a 16-bit
    model: more than the model's own weights count); 0 where the path does not show them."""
    tensors = [t for layer in getattr(path, "layers", ()) for t in layer if isinstance(t, torch.Tensor)]
    head = getattr(path, "head", None)
    tensors += [head] if isinstance(head, torch.Tensor) else []
    return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())


def round_or_none(value, digits: int = 3):
    return None if value is None else round(value, digits)


def stacked_rows_section(path, vocab: int, weights: int, bandwidth: float, launch: float, cached: int = CACHED,
                         repeats: int = 30, seed: int = 0) -> list[dict]:
    """The sessions section's rows for one path: per bucket B, B sessions of `cached` tokens each, one forward over
    k rows of each (k in SESSION_ROWS): ms, rows/s, against one session's forward, kernels and the floors."""
    from ..forward import Rows

    device = path.device
    buckets = tuple(getattr(path, "buckets", BUCKETS))
    rng = np.random.default_rng(seed)
    caches = [path.new_cache() for _ in range(max(buckets))]
    ids = [rng.integers(1, vocab, cached + max(SESSION_ROWS)).tolist() for _ in caches]
    path.batch([Rows(cache, own[:cached], 1, prompt=True) for cache, own in zip(caches, ids)])  # each one's tokens
    slot = path.cache_bytes()
    filled = slot * cached / getattr(path, "length", cached)  # the part of a slot its cached tokens fill
    rows, one = [], {}
    for sessions in buckets:
        row = {"ops": path.ops.name, "sessions": sessions, "ms": {}, "rows_per_s": {}, "rows_per_s_vs_one_session": {},
               "kernels": {}, "launch_floor_ms": {}, "memory_ratio": {}}
        floor = (weights + sessions * slot) / (bandwidth / 2) * 1e3
        row["memory_floor_ms"] = round(floor, 4)
        row["memory_floor_filled_ms"] = round((weights + sessions * filled) / (bandwidth / 2) * 1e3, 4)
        for k in SESSION_ROWS:
            batch = [Rows(caches[n], ids[n][cached : cached + k], k, generating=True) for n in range(sessions)]

            def forward():
                path.batch(batch)
                for cache in caches[:sessions]:
                    cache.crop(cached)

            ms = synchronized_ms(forward, repeats, device)
            one.setdefault(k, ms)  # the first bucket's: one session
            count = kernels(forward, device)
            row["ms"][k] = round(ms, 4)
            row["rows_per_s"][k] = round(sessions * k / (ms / 1e3), 1)
            row["rows_per_s_vs_one_session"][k] = round(sessions * one[k] / ms, 3)
            row["kernels"][k] = count
            row["launch_floor_ms"][k] = round_or_none(None if count is None else count * launch / 1e3)
            row["memory_ratio"][k] = round(ms / floor, 2)
        rows.append(row)
    caches.clear()  # (their slots go back to the pool)
    return rows


def floors(device) -> tuple[float, float]:
    """The measured copy bandwidth (bytes/s, read and written) and the cost of one launch (us) on the device."""
    return copy_bandwidth(device=device), launch_us(device=device)


def sessions_section(model, ops: list[str], cached: int = CACHED, repeats: int = 30,
                     measured: tuple[float, float] | None = None) -> dict:
    """The stacked forward of 1-16 sessions on `model` (its device), for each of `ops` (a choice this GraphLlama
    cannot make is reported in `skipped`)."""
    from .forward_costs import weight_bytes

    device = model.device
    context = int(model.config.max_position_embeddings)
    weights = weight_bytes(model)
    bandwidth, launch = measured or floors(device)
    lean = graph_lean(model)
    rows, skipped, paths = [], {}, {}
    for choice in ops:
        try:
            path = GraphLlama(lean, context, ops=choice, compiled=False)
            rows += stacked_rows_section(path, model.config.vocab_size, weights, bandwidth, launch, cached, repeats)
            paths[choice] = {"reads": getattr(path, "reads", ""), "ops": path.ops.name,
                             "cache_slot_mb": round(path.cache_bytes() / 1e6, 2),
                             "forward_weights_mb": round(path_weight_bytes(path) / 1e6, 2)}
        except Exception as error:  # an operation set that cannot run here (no Triton, an old GraphLlama): say so
            skipped[choice] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        finally:
            path = None
            gc.collect()
            if is_cuda(device):
                torch.cuda.empty_cache()
    return {"device": device_name(device), "device_type": device.type,
            "dtype": str(model.dtype).removeprefix("torch."), "weights_mb": round(weights / 1e6, 2),
            "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "launch_us": round(launch, 2), "context": context,
            "cached": cached, "rows_per_session": list(SESSION_ROWS),
            "paths": paths, "skipped": skipped, "rows": rows}


def format_sessions(data: dict) -> str:
    """sessions_section's table: per operations and bucket, ms at k=1 and k=16, rows/s, against one session, the
    kernels and the floors."""
    lines = [f"B sessions x k rows in one forward on {data['device']}, {data['dtype']}, {data['cached']} cached tokens "
             f"each (a launch {data['launch_us']} us, copies {data['copy_bandwidth_gb_s']} GB/s, weights "
             f"{data['weights_mb']} MB)"]
    header = (f"{'ops':7} {'B':>3} {'ms k=1':>8} {'ms k=16':>8} {'rows/s k=1':>11} {'rows/s k=16':>12} "
              f"{'vs one k=1':>10} {'vs one k=16':>11} {'kernels':>8} {'launch':>7} {'memory':>7} {'x mem k=1':>9}")
    lines += [header, "-" * len(header)]
    for row in data["rows"]:
        ms, rate, gain = ({int(k): v for k, v in row[key].items()} for key in ("ms", "rows_per_s",
                                                                              "rows_per_s_vs_one_session"))
        count = {int(k): v for k, v in row["kernels"].items()}.get(1)
        launch = {int(k): v for k, v in row["launch_floor_ms"].items()}.get(1)
        ratio = {int(k): v for k, v in row["memory_ratio"].items()}.get(1)
        lines.append(f"{row['ops']:7} {row['sessions']:3d} {ms[1]:8.3f} {ms[16]:8.3f} {rate[1]:11.0f} {rate[16]:12.0f} "
                     f"{gain[1]:9.2f}x {gain[16]:10.2f}x {'-' if count is None else count:>8} "
                     f"{'-' if launch is None else f'{launch:.2f}':>7} {row['memory_floor_ms']:7.3f} {ratio:8.1f}x")
    for choice, why in data["skipped"].items():
        lines.append(f"{choice}: not run ({why})")
    lines.append("vs one: rows/s over one session's forward (B x its ms over the stacked forward's); kernels and "
                 "launch at k=1 (kernels counted on CUDA only); memory: the weights and the B sessions' cache slots at "
                 "the copy bandwidth")
    return "\n".join(lines)


def shape_config(shape: Shape, dtype: torch.dtype, context: int | None = None):
    """A transformers config of `shape` (zoo.Shape): Llama's, or Qwen2's (q/k/v biases), in `dtype`."""
    from transformers import LlamaConfig, Qwen2Config

    kind = Qwen2Config if shape.arch == "qwen2" else LlamaConfig
    return kind(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                max_position_embeddings=context or shape.context, rope_theta=shape.rope_theta, rms_norm_eps=1e-6,
                tie_word_embeddings=shape.tied, dtype=dtype)


def shape_model(shape: Shape, device, dtype: torch.dtype, context: int | None = None, seed: int = 0):
    """A random-weight model of `shape`, made on the device in `dtype` (a 7B's bfloat16 weights never in float32,
    nor in host memory)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(shape, dtype, context), dtype=dtype)
    return model.eval()


def shapes_section(names: list[str], device, dtype: torch.dtype, ops: list[str], cached: int = CACHED,
                   repeats: int = 30, measured: tuple[float, float] | None = None, partial=None) -> dict:
    """Per shape and operations: one session's forward over k rows (k in SESSION_ROWS) on `cached` tokens, with the
    graph-safe forward (CUDA graphs on CUDA), against its memory floor (the weights and its cache slot). partial:
    called with the section's data so far after each shape (a run stopped by a timeout keeps those)."""
    from ..forward import Rows
    from .forward_costs import weight_bytes

    unknown = [name for name in names if name not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {', '.join(unknown)}; shapes: {', '.join(SHAPES)}")
    bandwidth, launch = measured or floors(device)
    rows = []
    data = {"device": device_name(device), "device_type": torch.device(device).type,
            "dtype": str(dtype).removeprefix("torch."), "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "launch_us": round(launch, 2), "cached": cached, "rows_per_session": list(SESSION_ROWS),
            "rows": rows}
    for name in names:
        shape = SHAPES[name]
        model = shape_model(shape, device, dtype)
        weights = weight_bytes(model)
        lean = graph_lean(model)
        for choice in ops:
            row = {"shape": name, "ops": choice, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                   "weights_mb": round(weights / 1e6, 1), "context": shape.context}
            try:
                path = GraphLlama(lean, shape.context, ops=choice, compiled=False)
                row.update(ops=path.ops.name, reads=getattr(path, "reads", ""),
                           cache_slot_mb=round(path.cache_bytes() / 1e6, 2),
                           forward_weights_mb=round(path_weight_bytes(path) / 1e6, 1))
                floor = (weights + path.cache_bytes()) / (bandwidth / 2) * 1e3
                row.update(memory_floor_ms=round(floor, 4), ms={}, memory_ratio={}, kernels={})
                cache = path.new_cache()
                rng = np.random.default_rng(0)
                ids = rng.integers(1, shape.vocab, cached + max(SESSION_ROWS)).tolist()
                path.batch([Rows(cache, ids[:cached], 1, prompt=True)])
                for k in SESSION_ROWS:
                    batch = [Rows(cache, ids[cached : cached + k], k, generating=True)]

                    def forward():
                        path.batch(batch)
                        cache.crop(cached)

                    ms = synchronized_ms(forward, repeats, device)
                    row["ms"][k] = round(ms, 4)
                    row["memory_ratio"][k] = round(ms / floor, 2)
                    row["kernels"][k] = kernels(forward, device)
            except Exception as error:  # (Triton missing, an old GraphLlama, no memory for the shape): say so
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            finally:
                cache = path = None
            rows.append(row)
            print(f"  {name} ({choice}): " + (row.get("error") or f"{row['ms']} ms, floor {row['memory_floor_ms']} "
                                             "ms"), file=sys.stderr, flush=True)
        del model, lean
        gc.collect()
        if is_cuda(device):
            torch.cuda.empty_cache()
        if partial is not None:
            partial(data)
    return data


def format_shapes(data: dict) -> str:
    """shapes_section's table: ms at k=1 and k=16 against the memory floor, per shape and operations."""
    lines = [f"one session's forward on {data['device']}, {data['dtype']}, random weights, {data['cached']} cached "
             f"tokens (copies {data['copy_bandwidth_gb_s']} GB/s)"]
    header = (f"{'shape':20} {'ops':7} {'weights MB':>10} {'ms k=1':>8} {'ms k=16':>8} {'memory':>8} "
              f"{'x mem k=1':>9} {'x mem k=16':>10} {'kernels':>8}")
    lines += [header, "-" * len(header)]
    for row in data["rows"]:
        if "error" in row:
            lines.append(f"{row['shape']:20} {row['ops']:7} {row['weights_mb']:10.1f}  ({row['error']})")
            continue
        ms, ratio, count = ({int(k): v for k, v in row[key].items()} for key in ("ms", "memory_ratio", "kernels"))
        lines.append(f"{row['shape']:20} {row['ops']:7} {row['weights_mb']:10.1f} {ms[1]:8.3f} {ms[16]:8.3f} "
                     f"{row['memory_floor_ms']:8.3f} {ratio[1]:8.1f}x {ratio[16]:9.1f}x "
                     f"{'-' if count[1] is None else count[1]:>8}")
    lines.append("memory: the weights and the session's cache slot at the copy bandwidth; kernels at k=1 (CUDA only)")
    return "\n".join(lines)
