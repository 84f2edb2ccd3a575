import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run several times faster on one thread than on two busy ones (the test machines
    have two cores); restored afterwards so the default-model tests keep every thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_cpu(*features): the test's kernels need these CPU features (LLVM's "
                            "names, e.g. avx512vnni); on a CPU without them it must be refused with an error naming "
                            "one (llvmir.MissingInstructions or a CodespecError), never an abort nor a silent result")


def _plain(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """needs_cpu: where the CPU has the features, the test runs as written. Where it lacks one (an AVX2 laptop, an
    ARM64 Mac, some CI hosts), what the test asks for must fail cleanly instead: its numbers are checked on CPUs
    that have the instructions (and test_kernel_targets compiles those tiles for Zen 4 on any x86 host)."""
    from codespec.errors import CodespecError
    from codespec.llvmir import MissingInstructions, host_has

    marker = item.get_closest_marker("needs_cpu")
    missing = [feature for feature in (marker.args if marker else ()) if not host_has(feature)]
    if not missing:
        return (yield)
    try:
        yield
    except (MissingInstructions, CodespecError) as error:
        if any(_plain(feature) in _plain(str(error)) for feature in marker.args):
            return None  # refused, naming what is missing
        raise
    raise AssertionError(f"this CPU lacks {', '.join(missing)}, yet the test's kernels ran without an error")
