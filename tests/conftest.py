import numpy as np
import pytest
import torch

from codespec.config import SpecConfig
from codespec.engine import Engine
from tests.tiny import DEVICE, EOS, save_tiny, tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def model():
    torch.set_grad_enabled(False)
    return tiny_model().to(DEVICE)  # float64; CODESPEC_TEST_DEVICE=cuda runs the tests that use it on a GPU


@pytest.fixture
def engine(model, tokenizer):
    return Engine(model, tokenizer, SpecConfig(), eos_token_ids=frozenset({EOS}))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-model"))


def random_prompt(rng: np.random.Generator, length: int, repetitive: bool) -> list[int]:
    """Random token prompts; repetitive ones repeat a short motif so prompt lookup has matches."""
    if not repetitive:
        return rng.integers(1, 384, size=length).tolist()
    motif = rng.integers(1, 384, size=int(rng.integers(3, 9))).tolist()
    noise = rng.integers(1, 384, size=length).tolist()
    return [motif[i % len(motif)] if rng.random() < 0.85 else noise[i] for i in range(length)]


# Twice on 2026-11-25, a full run reported every test passed and then died with a segmentation fault while the
# interpreter tore down (after pytest's faulthandler was gone; not reproduced alone): daemon engine threads,
# llvmlite's engines, libgomp and PyTorch end in some order. Until it is found, the run ends with pytest's own
# exit status once pytest has finished everything, without the teardown.
def pytest_sessionfinish(session, exitstatus):
    session.config.codespec_exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import os
    import sys

    status = getattr(config, "codespec_exit_status", None)
    if status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_kernels(*kernels): the test runs these kernels (their names in "
                            "codespec/forward/kernels/capabilities.py's table); on a CPU without what the table says "
                            "they need, what the test asks for must be refused with an error naming a missing feature "
                            "(capabilities.MissingInstructions or a CodespecError), never an abort nor a silent result")


def _plain(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """needs_kernels: where the CPU has what the capability table says the kernels need, the test runs as written.
    Where it lacks one (an AVX2 laptop, an ARM64 Mac, some CI hosts), what the test asks for must fail cleanly
    instead: its numbers are checked on CPUs that have the instructions (and test_kernel_targets compiles those tiles for Zen 4 on any x86 host)."""
    from codespec.errors import CodespecError
    from codespec.forward.kernels import capabilities
    from codespec.forward.kernels.capabilities import MissingInstructions

    marker = item.get_closest_marker("needs_kernels")
    kernels = marker.args if marker else ()
    missing = sorted({feature for kernel in kernels for feature in capabilities.missing(kernel)})
    if not missing:
        return (yield)
    try:
        yield
    except (MissingInstructions, CodespecError) as error:
        if any(_plain(feature) in _plain(str(error)) for feature in missing):
            return None  # refused, naming what is missing
        raise
    raise AssertionError(f"this CPU lacks {', '.join(missing)}, yet the test's kernels ran without an error")
