"""engine.TextAssembler decodes only the last few tokens again each step (a whole decode cost 264 us a step at 512
tokens): its text must still be exactly the whole decode after every step, for byte-level BPE (the default model's,
Qwen's, Llama 3's: a step may end inside a UTF-8 character) and for a Metaspace tokenizer (SentencePiece's
convention, whose decode drops the first token's leading space: a decode from the middle differs)."""

import inspect
import textwrap

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from codespec.engine import TextAssembler
from tests.tiny import tiny_tokenizer


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    bpe.train_from_iterator([inspect.getsource(textwrap) + " héllo wörld ünïcode ✓ 漢字"],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="<unk>")


@pytest.mark.parametrize("make", [tiny_tokenizer, metaspace_tokenizer])
@pytest.mark.parametrize("seed", range(3))
def test_the_text_after_every_step_is_the_whole_decode(make, seed):
    tokenizer = make()
    rng = np.random.default_rng(seed)
    text = inspect.getsource(TextAssembler) + " naïve café — ✓ 漢字 "
    real = tokenizer.encode(text)
    sequences = [real, rng.integers(0, len(tokenizer), 300).tolist()]  # real text, and random bytes and pieces
    for tokens in sequences:
        assembler, sent, done = TextAssembler(tokenizer, ()), "", 0
        while done < len(tokens):
            step = int(rng.integers(1, 5))
            delta, stop = assembler.add(tokens[done : done + step])
            done += step
            sent += delta
            assert stop is None
            assert assembler.text == tokenizer.decode(tokens[:done], skip_special_tokens=True), done
        assert sent + assembler.flush() == assembler.text
    assert assembler.mark > 0  # the mark moved: the windowed decode ran


def test_a_stop_string_after_the_mark_cuts_the_text_and_the_tokens():
    tokenizer = tiny_tokenizer()
    tokens = tokenizer.encode(inspect.getsource(textwrap)[:2000])
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    stop = full[1500:1512]  # far past the first marks
    assembler = TextAssembler(tokenizer, (stop,))
    done, count = 0, None
    while count is None and done < len(tokens):
        _, count = assembler.add(tokens[done : done + 3])
        done += 3
    assert count is not None and assembler.mark == 0 and assembler.text == full[: full.index(stop)]
    assert stop in tokenizer.decode(assembler.tokens) and stop not in tokenizer.decode(assembler.tokens[:-1])
