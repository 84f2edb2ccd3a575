"""`codespec bench --zoo`: the files people download, at the shapes they run, side by side with llama-server.

No download: each model is random weights at the shape its published config gives (SHAPES), written as an F16
GGUF with a real tokenizer (the default model's BPE vocabulary, padded with unused tokens to the model's size),
then quantized by llama.cpp's own `llama-quantize` into each type (Q8_0, Q4_K_M, Q5_K_M, Q6_K, Q4_0; build it with
python -m codespec.bench.build_llama_server, beside llama-server). Random weights run at the speed trained ones do:
a forward reads the same bytes and does the same arithmetic (the text they write is noise, and is not compared).

Per file, each engine in a process of its own (so that its peak memory is its own):
- codespec: load seconds (Engine.load, the file read directly, in a second process: the first builds the config
  and tokenizer from the file's metadata, its whole run's wall time reported beside), peak RSS, one forward's ms at k = 1, 4 and 16 on
  256 cached tokens next to its floor (the bytes its kernels read over this machine's read bandwidth), prefill
  tok/s (a 512-token prompt), plain decode tok/s (64 tokens after it);
- llama-server: load seconds (start to /health), peak RSS (VmHWM), prefill and decode tok/s from its own timings
  for the same prompt and length, greedy, 2 threads (codespec's own count).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CodespecError


@dataclass(frozen=True)
class Shape:
    arch: str  # the GGUF architecture: llama or qwen2 (q/k/v biases)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float = 10000.0
    context: int = 8192


# From each model's published config.json (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, vocab_size, tie_word_embeddings, rope_theta).
SHAPES = {
    "qwen2.5-coder-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 151936, True, 1000000.0),
    "qwen2.5-coder-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 151936, True, 1000000.0),
    "qwen2.5-coder-3b": Shape("qwen2", 2048, 11008, 36, 16, 2, 151936, True, 1000000.0),
    "qwen2.5-coder-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, False, 1000000.0),
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 128256, True, 500000.0),
    "smollm2-1.7b": Shape("llama", 2048, 8192, 24, 32, 32, 49152, True, 130000.0),
}
TYPES = ("Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0")
PROMPT, DECODE = 512, 64  # prompt tokens, then generated ones
F16 = 1  # GGUF file_type "mostly F16"


def tensors(shape: Shape):
    """(name, dims as ggml lists them, kind) of every tensor, in llama.cpp's order: "w" a projection (random, F16),
    "n" a norm (ones, F32), "b" a bias (random, F32)."""
    head_dim = shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    yield "token_embd.weight", (shape.hidden, shape.vocab), "w"
    for i in range(shape.layers):
        yield f"blk.{i}.attn_norm.weight", (shape.hidden,), "n"
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            yield f"blk.{i}.{name}.weight", (shape.hidden, rows), "w"
            if shape.arch == "qwen2":
                yield f"blk.{i}.{name}.bias", (rows,), "b"
        yield f"blk.{i}.attn_output.weight", (q, shape.hidden), "w"
        yield f"blk.{i}.ffn_norm.weight", (shape.hidden,), "n"
        yield f"blk.{i}.ffn_gate.weight", (shape.hidden, shape.intermediate), "w"
        yield f"blk.{i}.ffn_up.weight", (shape.hidden, shape.intermediate), "w"
        yield f"blk.{i}.ffn_down.weight", (shape.intermediate, shape.hidden), "w"
    yield "output_norm.weight", (shape.hidden,), "n"
    if not shape.tied:
        yield "output.weight", (shape.hidden, shape.vocab), "w"


def _copy_tokenizer(writer, source: Path, vocab: int) -> None:
    """The default model's BPE tokenizer (tokens, types, merges, special ids, chat template), its vocabulary padded
    with unused user-defined tokens to `vocab` entries (llama.cpp wants one per embedding row)."""
    import gguf

    from ..forward.gguf_model import field

    reader = gguf.GGUFReader(str(source))

    def strings(name):
        found = reader.fields[name]
        return [bytes(found.parts[i]).decode("utf-8") for i in found.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    types = [int(reader.fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in reader.fields["tokenizer.ggml.token_type"].data]
    extra = vocab - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(field(source, "tokenizer.ggml.pre") or "default")
    writer.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(extra)])
    writer.add_token_types(types + [gguf.TokenType.USER_DEFINED] * extra)
    writer.add_token_merges(merges)
    for name, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("padding_token_id", writer.add_pad_token_id)):
        value = field(source, f"tokenizer.ggml.{name}")
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(False)


def write_random_gguf(shape: Shape, path: Path, tokenizer: Path, seed: int = 0) -> Path:
    """An F16 GGUF of random weights (std 0.02; norms one) at `shape`, written one tensor at a time (a 7B's
    15 GB never in memory at once)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(f"random {shape.arch} {shape.hidden}x{shape.layers}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(F16)
    _copy_tokenizer(writer, tokenizer, shape.vocab)
    listed = list(tensors(shape))
    for name, dims, kind in listed:
        dtype = np.float16 if kind == "w" else np.float32
        count = int(np.prod(dims))
        writer.add_tensor_info(name, list(reversed(dims)), np.dtype(dtype), count * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in listed:
        shape_rows = tuple(reversed(dims))
        if kind == "n":
            values = np.ones(shape_rows, np.float32)
        elif kind == "b":
            values = (rng.standard_normal(shape_rows, np.float32) * 0.02).astype(np.float32)
        else:
            values = (rng.standard_normal(shape_rows, np.float32) * 0.02).astype(np.float16)
        writer.write_tensor_data(values)
    writer.close()
    return path


def quantize(quantizer: Path, source: Path, target: Path, kind: str) -> Path:
    """`source` quantized into `target`, written under another name first (a run stopped halfway leaves no file
    that a later run would take for a whole one)."""
    partial = target.with_suffix(".partial")
    done = subprocess.run([str(quantizer), str(source), str(partial), kind, str(os.cpu_count() or 1)],
                          capture_output=True, text=True)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise CodespecError(f"llama-quantize {kind} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return partial.rename(target)


def measure_codespec(path: Path, load_only: bool = False) -> dict:
    """In this process (run it in one of its own: `python -m codespec.bench.zoo FILE`): load, forward and
    generation figures of codespec on `path` (load_only: the load's)."""
    import torch

    from ..adaptive import measure_costs
    from ..config import ModelConfig, SamplingParams, SpecConfig
    from ..engine import Engine
    from ..forward import Rows
    from .forward_costs import read_bandwidth

    started = time.perf_counter()
    engine = Engine.load(ModelConfig(model=str(path)), show_progress=False)
    load = time.perf_counter() - started
    rss = peak_rss_self()
    if load_only:
        return {"engine": "codespec", "load_s": round(load, 2), "peak_rss_mb": round(rss / 1e6)}
    path_ = engine.path
    vocab = engine.model.config.vocab_size
    costs = measure_costs(path_, vocab, sizes=(1, 4, 16), repeats=3, longer=0)
    weights = path_.kernel_weights.nbytes if getattr(path_, "kernel_weights", None) is not None else 0
    ids = np.random.default_rng(1).integers(0, min(vocab, 49152), PROMPT).tolist()
    cache = path_.new_cache()
    started = time.perf_counter()
    for start in range(0, PROMPT, 128):  # the server's chunks
        path_.batch([Rows(cache, ids[start : start + 128], 1, prompt=True)])
    prefill = PROMPT / (time.perf_counter() - started)
    engine.eos_token_ids = frozenset({-1})  # (random weights: all DECODE tokens, whatever they are)
    result = engine.generate(ids, SamplingParams(max_tokens=DECODE), spec=SpecConfig(spec=("none",)))
    decode_seconds = result.stats.seconds - result.stats.prefill_seconds
    return {"engine": "codespec", "plan": str(engine.plan), "load_s": round(load, 2), "peak_rss_mb": round(rss / 1e6),
            "ms": {k: round(s * 1e3, 2) for k, s in zip(costs.sizes, costs.seconds)},
            "floor_ms": round(weights / read_bandwidth() * 1e3, 2), "read_mb": round(weights / 1e6),
            "prefill_tok_s": round(prefill, 1),
            "decode_tok_s": round((len(result.tokens) - 1) / decode_seconds, 1) if decode_seconds > 0 else None,
            "tokens": len(result.tokens), "threads": torch.get_num_threads()}


def measure_llama_server(binary: Path, path: Path, threads: int) -> dict:
    """llama-server on `path`: start to /health, its peak RSS, and its own prefill and decode rates for a
    PROMPT-token prompt and DECODE tokens (greedy, ignoring end of text)."""
    import urllib.request

    from .llama_server import LlamaServer, ServerSetting

    server = LlamaServer(binary, path, ServerSetting("llama-server plain", []), threads=threads, startup_timeout=600)
    started = time.perf_counter()
    server.start()
    load = time.perf_counter() - started
    try:
        ids = np.random.default_rng(1).integers(0, 49152, PROMPT).tolist()
        body = json.dumps({"prompt": ids, "n_predict": DECODE, "temperature": 0.0, "top_k": 1, "seed": 0,
                           "cache_prompt": False, "ignore_eos": True, "stream": False}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as answer:
            timings = json.loads(answer.read())["timings"]
        peak = _peak_rss(server.process.pid)
    finally:
        server.close()
    return {"engine": "llama-server", "load_s": round(load, 2), "peak_rss_mb": round(peak / 1e6) if peak else None,
            "prefill_tok_s": round(timings["prompt_per_second"], 1),
            "decode_tok_s": round(timings["predicted_per_second"], 1), "tokens": timings["predicted_n"]}


def peak_rss_self() -> int:
    """This process's peak resident bytes: getrusage's ru_maxrss, in KiB on Linux and in bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _peak_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run(shapes: list[str], kinds: list[str], folder: Path, llama_server: Path | None, threads: int,
        keep: bool = False) -> list[dict]:
    """Every shape x type: write (once per shape), quantize, measure both engines; quantized files are deleted
    after their row unless `keep` (a 7B's five files take ~30 GB)."""
    from ..forward.models import locate_default_gguf
    from .build_llama_server import quantizer as quantizer_of

    unknown = [name for name in shapes if name not in SHAPES] + [kind for kind in kinds if kind not in TYPES]
    if unknown:
        raise CodespecError(f"--zoo: unknown {', '.join(unknown)}; shapes: {', '.join(SHAPES)}; types: "
                            f"{', '.join(TYPES)}")
    if llama_server is None:
        raise CodespecError("--zoo quantizes with llama-quantize and runs llama-server beside codespec: pass "
                            "--llama-server PATH (python -m codespec.bench.build_llama_server builds both)")
    quantizer = quantizer_of(llama_server)
    if not quantizer.is_file():
        raise CodespecError(f"--zoo needs llama-quantize beside llama-server ({quantizer}): rebuild with "
                            "python -m codespec.bench.build_llama_server")
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in shapes:
        f16 = folder / f"{name}-F16.gguf"
        if not f16.is_file():
            print(f"zoo: writing {f16.name}", file=sys.stderr, flush=True)
            write_random_gguf(SHAPES[name], f16.with_suffix(".partial"), locate_default_gguf()).rename(f16)
        for kind in kinds:
            target = folder / f"{name}-{kind}.gguf"
            if not target.is_file():
                print(f"zoo: quantizing {target.name}", file=sys.stderr, flush=True)
                quantize(quantizer, f16, target, kind)
            row = {"model": name, "type": kind, "file_mb": round(target.stat().st_size / 1e6)}
            first = time.perf_counter()  # a first load builds the config and tokenizer from the file's metadata
            subprocess.run([sys.executable, "-m", "codespec.bench.zoo", str(target), "--load-only"],
                           capture_output=True, text=True)
            first = time.perf_counter() - first
            done = subprocess.run([sys.executable, "-m", "codespec.bench.zoo", str(target)], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                row["codespec"] = {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
            else:
                row["codespec"] = {**json.loads(done.stdout.strip().splitlines()[-1]),
                                   "first_run_s": round(first, 1)}
            try:  # (a row that fails is reported as such; the other rows still run and are written)
                row["llama-server"] = measure_llama_server(llama_server, target, threads)
            except CodespecError as exc:
                row["llama-server"] = {"error": str(exc).splitlines()[0][:300]}
            print(format_row(row), file=sys.stderr, flush=True)
            rows.append(row)
            if not keep:
                target.unlink()
    return rows


HEADER = (f"{'model':20} {'type':7} {'MB':>6} | {'engine':12} {'load s':>6} {'RSS MB':>7} {'k=1':>7} {'k=4':>7} "
          f"{'k=16':>7} {'floor':>6} {'prefill':>8} {'decode':>7}")


def format_row(row: dict) -> str:
    lines = []
    for engine in ("codespec", "llama-server"):
        data = row.get(engine, {})
        if "error" in data:
            lines.append(f"{row['model']:20} {row['type']:7} {row['file_mb']:6} | {engine:12} error: {data['error']}")
            continue
        ms = data.get("ms", {})
        cells = [f"{ms.get(k, ms.get(str(k), '-')):>7}" for k in (1, 4, 16)]
        lines.append(f"{row['model']:20} {row['type']:7} {row['file_mb']:6} | {engine:12} {data['load_s']:6} "
                     f"{str(data.get('peak_rss_mb')):>7} {' '.join(cells)} {str(data.get('floor_ms', '-')):>6} "
                     f"{data['prefill_tok_s']:8} {str(data['decode_tok_s']):>7}")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    ratios = []
    for row in rows:
        ours, theirs = row.get("codespec", {}), row.get("llama-server", {})
        if ours.get("decode_tok_s") and theirs.get("decode_tok_s"):
            ratios.append(f"{row['model']} {row['type']}: decode {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x "
                          f"llama-server's, prefill {ours['prefill_tok_s'] / theirs['prefill_tok_s']:.2f}x")
    return "\n".join([HEADER, "-" * len(HEADER)] + [format_row(row) for row in rows] + [""] + ratios +
                     ["ms: one forward over k tokens on 256 cached (codespec); floor: the bytes its kernels read "
                      "over this machine's read bandwidth; prefill, decode: tok/s"])


if __name__ == "__main__":  # one file's codespec figures, in a process of its own (its peak RSS is its own)
    files = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    if len(files) != 1 or not Path(files[0]).is_file() or set(sys.argv[1:]) - {*files, "--load-only"}:
        sys.exit("usage: python -m codespec.bench.zoo FILE.gguf [--load-only]: one GGUF's load, forward and decode "
                 "figures in codespec, as JSON")
    try:
        print(json.dumps(measure_codespec(Path(files[0]), load_only="--load-only" in sys.argv)))
    except CodespecError as exc:
        sys.exit(f"codespec: {exc}")
