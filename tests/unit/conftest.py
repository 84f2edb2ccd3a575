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

