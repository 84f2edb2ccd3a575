"""The default model through the graph-safe forward (the default on GPUs) on the device the tests are given
(CODESPEC_TEST_DEVICE: the CPU unless it names cuda): speculative greedy output is plain greedy output token for
token, and drafts are accepted."""

import pytest

from codespec.config import ModelConfig, SamplingParams, SpecConfig
from codespec.engine import Engine
from codespec.forward.graphs import GraphLlama
from tests.integration.test_default_model import PROMPTS
from tests.tiny import DEVICE

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine():
    # a 2,048-token context: the graph-safe forward attends over its whole (fixed) cache, which a CPU feels
    config = ModelConfig(device=DEVICE, dtype="float32", forward="graphs", extra={"max_position_embeddings": 2048})
    return Engine.load(config, show_progress=False)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_speculation_on_the_graph_safe_forward_is_plain_decoding(engine, name):
    assert isinstance(engine.path, GraphLlama) and engine.path.context == 2048
    text, chat = PROMPTS[name]
    prompt = engine.encode(text, chat=chat)
    params = SamplingParams(max_tokens=40)
    plain = engine.generate(prompt, params, spec=SpecConfig(spec=("none",)))
    fast = engine.generate(prompt, params)
    assert fast.tokens == plain.tokens
    assert fast.stats.target_forwards <= plain.stats.target_forwards
    if name != "prose":
        assert fast.stats.accepted_tokens > 10
