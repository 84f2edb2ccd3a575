import pytest
import torch

from codespec.config import ModelConfig
from codespec.engine import Engine


@pytest.fixture(scope="session")
def default_engine():
    """The embedded default model in float32 (exactness is checked in fp32; bf16 drifts).
    Pulled (converted from the wheel's GGUF) on first use, like every command does."""
    torch.set_grad_enabled(False)
    return Engine.load(ModelConfig(dtype="float32"), show_progress=False)
