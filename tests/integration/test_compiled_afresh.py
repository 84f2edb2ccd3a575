"""The same bits whether a process compiled the CPU kernels itself or loaded them from numba's cache (issue 36).

numba compiles a kernel once per machine and caches it; a fast-math loop inlined into another kernel could be
vectorised one way when compiled and another when the caller was loaded from the cache, and the default model's
greedy text then depended on which process had compiled what (the 24th token of this prompt: 1758 against 10204).
Every sum whose order matters is now an IR tile with its order written out (ir.softmax_ir)."""

import json
import os
import subprocess
import sys

SCRIPT = """
import hashlib, json
import numpy as np
from codespec.config import ModelConfig, SamplingParams, SpecConfig
from codespec.engine import Engine

def digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]

engine = Engine.load(ModelConfig(), show_progress=False)
prompt = engine.encode("Write a Python function that returns the n-th Fibonacci number.", chat=True)
cache = engine.path.new_cache()
logits = engine.path(cache, prompt, 1)
keys, values = cache.keys[:, :, :len(prompt)].numpy(), cache.values[:, :, :len(prompt)].numpy()
tokens = engine.generate(prompt, SamplingParams(max_tokens=48), spec=SpecConfig(spec=("none",))).tokens
print(json.dumps({"logits": digest(logits.numpy()), "keys": digest(keys), "values": digest(values),
                  "tokens": list(tokens)}))
"""


def test_a_process_that_compiles_the_kernels_gets_the_bits_of_one_that_loads_them_from_the_cache(tmp_path):
    folder = tmp_path / "numba"  # empty: the first process compiles every kernel, the second loads them all
    env = {**os.environ, "NUMBA_CACHE_DIR": str(folder)}
    runs, written = [], []
    for _ in range(2):
        runs.append(subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                                   timeout=900))
        assert runs[-1].returncode == 0, runs[-1].stderr[-3000:]
        written.append({path: path.stat().st_mtime_ns for path in folder.rglob("*.nbc")})
    assert written[0] and written[1] == written[0]  # (nothing compiled, so nothing written, the second time)
    first, second = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert len(first["tokens"]) == 48
    assert first == second
