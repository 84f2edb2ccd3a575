import os
from pathlib import Path

import pytest
import torch

from codespec.config import ModelConfig
from codespec.engine import Engine

# Every engine these tests start, in this process or in a server it spawns, verifies as many draft tokens as a
# quiet machine would: how much gets drafted must not follow whatever else this shared machine is running.
os.environ["CODESPEC_COSTS"] = str(Path(__file__).with_name("quiet-costs.json"))


@pytest.fixture(scope="session")
def default_engine():
    """The embedded default model in float32 (exactness is checked in fp32; bf16 drifts).
    Pulled (converted from the wheel's GGUF) on first use, like every command does."""
    torch.set_grad_enabled(False)
    return Engine.load(ModelConfig(dtype="float32"), show_progress=False)
