"""tokenizer.SavedTokenizer (a saved fast tokenizer read without transformers) against transformers' own class on the
same folder: every answer codespec asks of a tokenizer is the same. tests/integration/test_default_model.py checks
the default model's vocabulary the same way (compare)."""

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from codespec.forward.tokenizer import SavedTokenizer, readable
from tests.tiny import tiny_tokenizer

TEXTS = ["", "def squares(n):\n    return [i * i for i in range(n)]\n", "  leading and trailing  ", "\t\ttabs\n\n\n",
         "naïve café — 東京 😀 \u200b", "<eos> inside text<eos>", "x<eos>y", "a" * 300, "\\n is not a newline",
         "<|im_start|>user\nhi<|im_end|>"]

CHATS = [[{"role": "user", "content": "Rewrite: def f(): pass"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"},
          {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}],
         [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": None, "reasoning": "r"}]]

TEMPLATES = {
    "tiny": None,  # tests/tiny.py's
    "features": ("{{ bos_token or '' }}{% set ns = namespace(turns=0) %}{% for m in messages %}"
                 "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system first') }}{% endif %}"
                 "{% set ns.turns = ns.turns + 1 %}{% if m.get('content') is none %}{% continue %}{% endif %}"
                 "<{{ m['role'] }}>{{ m['content'] | tojson }}{% if m.get('reasoning_content') %}"
                 "[{{ m['reasoning_content'] }}|{{ m['thinking'] }}]{% endif %}{{ eos_token }}\n{% endfor %}"
                 "{{ ns.turns }}{% if add_generation_prompt %}{% generation %}<assistant>{% endgeneration %}{% endif %}"),
    "trimmed": "{%- for m in messages %}\n  {{- m.role }}: {{ m.content | trim }}\n{%- endfor %}\n",
}


def saved(tmp_path, template):
    tokenizer = tiny_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp_path)
    return SavedTokenizer(tmp_path), PreTrainedTokenizerFast.from_pretrained(tmp_path)


def compare(ours, theirs, texts=TEXTS, chats=CHATS) -> None:
    """Every answer codespec asks of a tokenizer, ours against transformers'."""
    assert len(ours) == len(theirs) and ours.vocab_size == theirs.vocab_size
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_ids == theirs.all_special_ids and ours.all_special_tokens == theirs.all_special_tokens
    assert set(ours.added_tokens_decoder) == set(theirs.added_tokens_decoder)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(theirs, name) and getattr(ours, f"{name}_id") == getattr(theirs, f"{name}_id")
    everything = list(range(len(theirs)))
    assert ours.convert_ids_to_tokens(everything) == theirs.convert_ids_to_tokens(everything)
    assert ours.convert_ids_to_tokens(everything, skip_special_tokens=True) == theirs.convert_ids_to_tokens(
        everything, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(7) == theirs.convert_ids_to_tokens(7)
    assert ours.chat_template == theirs.chat_template
    for text in texts:
        for special in (False, True):
            expected = theirs(text, add_special_tokens=special).input_ids
            assert ours(text, add_special_tokens=special).input_ids == expected == ours.encode(text, special)
            assert ours(text, add_special_tokens=special)["input_ids"] == theirs(text, add_special_tokens=special)[
                "input_ids"]
            assert ours(text, add_special_tokens=special, split_special_tokens=True).input_ids == theirs(
                text, add_special_tokens=special, split_special_tokens=True).input_ids
            assert ours(text, add_special_tokens=special).input_ids == expected  # (the split above does not stick)
        ids = theirs(text, add_special_tokens=False).input_ids
        pieces = theirs.convert_ids_to_tokens(ids)
        assert ours.convert_tokens_to_string(pieces) == theirs.convert_tokens_to_string(pieces)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
            mixed = ids[:3] + ours.all_special_ids + ids[3:]
            assert ours.decode(mixed, skip_special_tokens=skip) == theirs.decode(mixed, skip_special_tokens=skip)
    for chat in chats:
        for prompt in (False, True):
            for tokenize in (False, True):
                assert rendered(ours, chat, prompt, tokenize) == rendered(theirs, chat, prompt, tokenize)


def rendered(tokenizer, chat, prompt: bool, tokenize: bool):
    """The chat template's text or tokens for `chat`, or the error it raised (a template may refuse a message)."""
    try:
        out = tokenizer.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=tokenize, return_dict=False)
    except jinja2.TemplateError as exc:
        return type(exc), str(exc)
    return out if isinstance(out, str) else list(out)


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_a_saved_tokenizer_answers_as_transformers_does(tmp_path, template):
    ours, theirs = saved(tmp_path, TEMPLATES[template])
    assert readable(tmp_path)
    compare(ours, theirs)


def test_a_template_that_refuses_the_messages_raises_jinjas_error_as_transformers_does(tmp_path):
    ours, theirs = saved(tmp_path, TEMPLATES["features"])
    chat = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    for tokenizer in (ours, theirs):
        with pytest.raises(jinja2.TemplateError, match="system first"):
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("template", ["{{ messages.__class__ }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}",
                                      "{{ cycler.__init__.__globals__ }}", "{{ messages.append(1) }}",
                                      "{% set ns = namespace() %}{% set ns.__x = 1 %}{{ ns }}",
                                      "{{ namespace(_y=1) }}", "{{ dict.__init__ }}", "{{ dict.fromkeys('ab', 0) }}"])
def test_a_chat_template_runs_in_the_sandbox(tmp_path, template):
    """A GGUF's chat template is untrusted code: it reaches no Python internals and changes nothing it is given,
    rendering (or refusing) as under transformers."""
    ours, theirs = saved(tmp_path, template)

    def outcome(tokenizer):
        try:
            return tokenizer.apply_chat_template(CHATS[0], tokenize=False)
        except jinja2.exceptions.SecurityError:
            return "refused"

    assert outcome(ours) == outcome(theirs)
    assert "class" not in outcome(ours) and "<function" not in outcome(ours) and len(CHATS[0]) == 1


def test_only_a_fast_tokenizer_saved_whole_is_read_without_transformers(tmp_path):
    """Other classes (and a folder without one) go through AutoTokenizer (gguf_model.saved_tokenizer)."""
    assert not readable(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert readable(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    assert not readable(tmp_path)
