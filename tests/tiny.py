"""A tiny randomly initialised Llama with a real (tiny, freshly trained) BPE tokenizer, for fast tests."""

from __future__ import annotations

import inspect
import os
import textwrap
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from codespec.drafters import Draft, Drafter

# the device the device-aware tests run on: CODESPEC_TEST_DEVICE=cuda runs them on a GPU (docs/contributing.md, the GPU lane)
DEVICE = os.environ.get("CODESPEC_TEST_DEVICE", "cpu")
VOCAB = 384
EOS = 0  # "<eos>" is the first special token the trainer adds


def tiny_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([inspect.getsource(textwrap)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    return tokenizer


def tiny_config(vocab: int, context: int) -> dict:
    """The shape every tiny test model shares, whatever its architecture."""
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=context, initializer_range=0.1, eos_token_id=EOS,
                bos_token_id=None, pad_token_id=EOS, tie_word_embeddings=False)


def tiny_model(seed: int = 0, context: int = 512, dtype=torch.float64, vocab: int = VOCAB) -> LlamaForCausalLM:
    """float64 so that batched verification and one-token decoding round identically: a random
    model's logits have near-ties that float32 noise could flip, which would test numerics, not logic.
    Embeddings three times larger than the rest make the next token depend mostly on the current one, so
    greedy decoding walks a random function over tokens and falls into cycles with detours: prompt-lookup
    drafts are then both accepted and rejected (about 30% accepted on repetitive prompts)."""
    config = LlamaConfig(**tiny_config(vocab, context))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
        for module in model.modules():  # transformers starts biases at zero: make Qwen2's matter
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
        for name, parameter in model.named_parameters():  # and norms at one: make Qwen3's q/k norms matter
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


ARCHITECTURES = ("llama", "qwen2", "gemma3", "lfm2")
SLIDING_WINDOW = 16  # Gemma 3's local layers see this many tokens: less than every test prompt


def tiny_arch_model(kind: str, dtype=torch.float64, seed: int = 0, context: int = 512):
    """A tiny random model of another architecture, shaped like tiny_model: Qwen2 (attention biases), Qwen3
    (per-head q/k norms),
    Gemma 3 (sliding-window and global layers, its own norms and embedding scale) or LFM2 (short
    convolutions: recurrent state a cache cannot roll back)."""
    import transformers

    if kind == "llama":
        return tiny_model(seed, context, dtype)
    common = tiny_config(VOCAB, context)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**common)
    elif kind == "qwen3":  # per-head q/k norms; heads x head_dim (4 x 32) wider than the hidden size, as Qwen3's are
        config = transformers.Qwen3Config(**common, head_dim=32)
    elif kind == "gemma3":
        config = transformers.Gemma3TextConfig(**common, head_dim=16, sliding_window=SLIDING_WINDOW,
                                               layer_types=["sliding_attention", "full_attention"])
    elif kind == "lfm2":
        config = transformers.Lfm2Config(**common, layer_types=["conv", "full_attention"])
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
        for module in model.modules():  # transformers starts biases at zero: make Qwen2's matter
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
        for name, parameter in model.named_parameters():  # and norms at one: make Qwen3's q/k norms matter
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


def save_tiny(directory: Path, context: int = 512, vocab: int = VOCAB) -> Path:
    """A transformers directory, as `--model DIR` expects."""
    tiny_model(context=context, dtype=torch.float32, vocab=vocab).save_pretrained(directory)
    tiny_tokenizer(vocab).save_pretrained(directory)
    return directory


class FixedContinuation(Drafter):
    """Drafts a known continuation of the prompt (including anything past an EOS), deterministically."""

    name = "fixed"

    def __init__(self, prompt_len: int, continuation: list[int]):
        self.prompt_len, self.continuation = prompt_len, continuation

    def draft(self, history, max_tokens):
        done = len(history) - self.prompt_len
        return Draft(self.continuation[done : done + max_tokens]) if done < len(self.continuation) else None
