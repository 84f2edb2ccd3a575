"""Token healing: a prompt cut mid-token backs up over its last token, and the output must spell it first."""

import torch

from codespec.config import SamplingParams, SpecConfig
from codespec.context.fim import FimFormat, fim_prompt
from codespec.healing import Constraint, Vocabulary, heal

PLAIN = SpecConfig(spec=("none",))
CODE = "def wrap(text, width):\n    lines = []\n    for line in text.splitlines():\n        lines.append(line)\n"


def test_a_bare_newline_is_healed_and_a_finished_token_is_kept(tokenizer):
    vocabulary = Vocabulary(tokenizer)
    ids = tokenizer(CODE, add_special_tokens=False).input_ids
    healed_ids, piece = heal(vocabulary, ids, 0)
    assert healed_ids == ids[:-1] and vocabulary.text(piece) == "\n"
    longer = [vocabulary.pieces[t] for t in vocabulary.starting_with(piece)]
    assert any(p.startswith(piece) and len(p) > len(piece) for p in longer)  # newline plus indentation exists
    assert heal(vocabulary, ids, len(ids)) == (ids, None)  # `keep` tokens are never removed
    word = tokenizer("x = self.value", add_special_tokens=False).input_ids
    assert heal(vocabulary, word, 0) == (word, None)  # a typed word stays as typed
    special = tokenizer.convert_tokens_to_ids("<eos>")
    assert heal(vocabulary, ids + [special], 0) == (ids + [special], None)  # special tokens are not text


def test_the_constraint_allows_extensions_and_first_parts_and_follows_a_draft(tokenizer):
    vocabulary = Vocabulary(tokenizer)
    word = next(p for p in vocabulary.sorted if len(p) >= 4 and p[:2] in vocabulary.ids and p.isalpha())
    constraint = Constraint(vocabulary, word)
    allowed = set(vocabulary.allowed(word))
    assert vocabulary.ids[word] in allowed and vocabulary.ids[word[:2]] in allowed
    assert constraint.after(word, vocabulary.ids[word[:2]]) == word[2:]
    logits = torch.zeros(3, len(tokenizer))
    constraint.mask(logits, [vocabulary.ids[word[:2]], 5])
    assert torch.isfinite(logits[0]).sum() == len(allowed)
    assert torch.isfinite(logits[1]).sum() == len(vocabulary.allowed(word[2:]))  # the rest after the first part
    assert torch.isfinite(logits[2]).all()  # spelt by then: free


def test_healed_generation_spells_the_piece_first_drops_it_from_the_text_and_is_lossless(engine):
    ids = engine.tokenizer(CODE * 3, add_special_tokens=False).input_ids
    healed_ids, piece = engine.heal(ids)
    params = SamplingParams(max_tokens=24)
    plain = engine.generate(healed_ids, params, spec=PLAIN, healed=piece)
    first = engine.vocabulary.pieces[plain.tokens[0]]
    assert first.startswith(piece)
    with torch.no_grad():  # constrained greedy: the best token among those that start with the piece
        logits = engine.path(engine.path.new_cache(), healed_ids, 1)[-1]
    allowed = engine.vocabulary.allowed(piece)
    assert plain.tokens[0] == allowed[int(logits[allowed].argmax())]
    full = engine.tokenizer.decode(plain.tokens)
    assert plain.text == full.removeprefix("\n") and full.startswith("\n")
    for spec in (SpecConfig(spec=("prompt-lookup",), adaptive=False), SpecConfig(spec=("ngram-mod", "prompt-lookup"))):
        result = engine.generate(healed_ids, params, spec=spec, session_id=",".join(spec.spec), healed=piece)
        assert result.tokens == plain.tokens and result.text == plain.text


def test_fim_moves_the_healed_piece_from_the_prefix_into_the_middle(tokenizer):
    vocabulary = Vocabulary(tokenizer)
    fmt = FimFormat("starcoder", 1, 2, 3)
    prompt = fim_prompt(tokenizer, CODE, "    return lines\n", fmt=fmt, vocabulary=vocabulary)
    plain = fim_prompt(tokenizer, CODE, "    return lines\n", fmt=fmt)
    assert vocabulary.text(prompt.healed) == "\n" and plain.healed is None
    cut = plain.ids.index(2)  # the suffix marker: the prefix ends right before it
    assert prompt.ids == plain.ids[: cut - 1] + plain.ids[cut:]  # one token fewer at the end of the prefix
    assert prompt.ids[-1] == 3  # the prompt still ends with the middle marker
    fallback = fim_prompt(tokenizer, CODE, "", fmt=None, vocabulary=vocabulary)
    assert fallback.ids == fim_prompt(tokenizer, CODE, "", fmt=None).ids[:-1]
