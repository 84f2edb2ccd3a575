"""FIM prompts per model family, with small tokenizers that carry each family's special tokens (golden prompts),
and the prefix-only fallback's cut where the completion runs into the suffix."""

import pytest
from tokenizers import processors

from codespec.context.fim import SuffixTrimmer, detect_fim, fim_prompt, trim_to_suffix
from codespec.request.limits import OutputFilter
from tests.tiny import tiny_tokenizer

FAMILY_TOKENS = {
    "qwen": ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
             "<|endoftext|>"],
    "starcoder": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<repo_name>", "<file_sep>"],
    "starcoder1": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>", "<filename>"],
    "codellama": ["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>", "<s>"],
    "deepseek": ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "<|EOT|>", "<s>"],
    "smollm2": ["<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>"],
}

PREFIX, SUFFIX = "def area(w, h):\n    ", "\n\nprint(area(2, 3))\n"
EXTRA = [("geometry.py", "UNIT = 'cm'\n"), ("util.py", "def clamp(x):\n    return x\n")]


def family_tokenizer(family: str):
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS[family]})
    if "<s>" in FAMILY_TOKENS[family]:  # CodeLlama and DeepSeek put a beginning-of-sequence token before every text
        bos = tokenizer.convert_tokens_to_ids("<s>")
        tokenizer.bos_token = "<s>"
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos)])
    return tokenizer


def text_of(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


GOLDEN = {
    "qwen": "<|repo_name|>myproject\n<|file_sep|>geometry.py\nUNIT = 'cm'\n<|file_sep|>util.py\ndef clamp(x):\n"
            "    return x\n<|file_sep|>shapes.py\n<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX
            + "<|fim_middle|>",
    "starcoder": "<repo_name>myproject\n<file_sep>geometry.py\nUNIT = 'cm'\n<file_sep>util.py\ndef clamp(x):\n"
                 "    return x\n<file_sep>shapes.py\n<fim_prefix>" + PREFIX + "<fim_suffix>" + SUFFIX + "<fim_middle>",
    # StarCoder 1 has no <file_sep>: extra chunks are separated by a snippet line and no repo header is written
    "starcoder1": "\n\n--- snippet ---\n\nUNIT = 'cm'\n\n\n--- snippet ---\n\ndef clamp(x):\n    return x\n"
                  "<fim_prefix>" + PREFIX + "<fim_suffix>" + SUFFIX + "<fim_middle>",
    "codellama": "<s>\n\n--- snippet ---\n\nUNIT = 'cm'\n\n\n--- snippet ---\n\ndef clamp(x):\n    return x\n"
                 "▁<PRE>" + PREFIX + "▁<SUF>" + SUFFIX + "▁<MID>",
    "deepseek": "<s>\n\n--- snippet ---\n\nUNIT = 'cm'\n\n\n--- snippet ---\n\ndef clamp(x):\n    return x\n"
                "<｜fim▁begin｜>" + PREFIX + "<｜fim▁hole｜>" + SUFFIX + "<｜fim▁end｜>",
    # no FIM tokens: prefix-only, but its real <repo_name>/<file_sep> tokens still carry the extra files
    "smollm2": "<repo_name>myproject\n<file_sep>geometry.py\nUNIT = 'cm'\n<file_sep>util.py\ndef clamp(x):\n"
               "    return x\n<file_sep>shapes.py\n" + PREFIX,
}


@pytest.mark.parametrize("family", sorted(GOLDEN))
def test_golden_prompt(family):
    tokenizer = family_tokenizer(family)
    prompt = fim_prompt(tokenizer, PREFIX, SUFFIX, extra=EXTRA, filename="shapes.py")
    assert text_of(tokenizer, prompt.ids) == GOLDEN[family]
    assert prompt.extra_used == 2 and not prompt.truncated
    expected = {"starcoder1": "starcoder", "smollm2": None}.get(family, family)
    assert (prompt.format.name if prompt.format else None) == expected


@pytest.mark.parametrize("family", ["qwen", "starcoder", "codellama", "deepseek"])
def test_markers_are_single_special_tokens(family):
    """The markers go in as their own ids, never as text the tokenizer splits."""
    tokenizer = family_tokenizer(family)
    fmt = detect_fim(tokenizer)
    prompt = fim_prompt(tokenizer, PREFIX, SUFFIX)
    vocab = tokenizer.get_vocab()
    prefix_token, suffix_token, middle_token = FAMILY_TOKENS[family][:3]
    assert (fmt.prefix, fmt.suffix, fmt.middle) == (vocab[prefix_token], vocab[suffix_token], vocab[middle_token])
    assert prompt.ids[-1] == fmt.middle and prompt.ids.count(fmt.prefix) == 1
    assert fmt.stop_ids, "the family's end-of-middle tokens end generation"


def test_repo_layout_without_extra_files():
    """As llama.cpp: the repo header and the current file's name even when no other file is sent."""
    tokenizer = family_tokenizer("qwen")
    ids = fim_prompt(tokenizer, PREFIX, SUFFIX, filename="a.py").ids
    expected = "<|repo_name|>myproject\n<|file_sep|>a.py\n<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX
    assert text_of(tokenizer, ids) == expected + "<|fim_middle|>"


def test_special_token_text_in_code_stays_text():
    """A file that contains `<fim_middle>` must not reshape the prompt."""
    tokenizer = family_tokenizer("starcoder")
    fmt = detect_fim(tokenizer)
    ids = fim_prompt(tokenizer, "s = '<fim_middle>'\n", "", extra=[("x.py", "<file_sep>")]).ids
    assert ids.count(fmt.middle) == 1 and ids.count(fmt.file_sep) == 2  # x.py's header and the current file's


def test_budget_drops_old_extra_chunks_then_cuts_prefix_start_and_suffix_end():
    tokenizer = family_tokenizer("starcoder")
    full = fim_prompt(tokenizer, PREFIX, SUFFIX, extra=EXTRA)
    last_only = fim_prompt(tokenizer, PREFIX, SUFFIX, extra=EXTRA[1:])
    cut = fim_prompt(tokenizer, PREFIX, SUFFIX, extra=EXTRA, max_tokens=len(full.ids) - 1)
    assert cut.truncated and cut.extra_used == 1 and cut.ids == last_only.ids  # the oldest chunk went first
    long_prefix = "x = 1\n" * 200
    tight = fim_prompt(tokenizer, long_prefix + PREFIX, SUFFIX * 50, max_tokens=120)
    assert tight.truncated and tight.extra_used == 0 and len(tight.ids) <= 120
    text = text_of(tokenizer, tight.ids)
    assert text.split("<fim_suffix>")[0].endswith(PREFIX)  # the end of the prefix stays (next to the cursor)
    assert text.split("<fim_suffix>")[1].startswith(SUFFIX[:10])  # the start of the suffix stays
    assert len(text.split("<fim_suffix>")[0]) > 3 * len(text.split("<fim_suffix>")[1]) / 2  # prefix gets most room


TRIM_CASES = [
    # (completion, suffix, trimmed)
    ("return w * h\n\nprint(area(2, 3))\nprint(1)", "\n\nprint(area(2, 3))\n", "return w * h"),
    ("return w * h\n\n\nprint(area(2, 3))", "\n\nprint(area(2, 3))\n", "return w * h"),
    ("return w * h\n", "\n\nprint(area(2, 3))\n", "return w * h\n"),  # never ran into it: unchanged
    ("a, b)\nfoo()", ")\nfoo()\n", "a, b"),  # mid-line: the line ends with the rest of the cursor's line
    ("a, b)", ")\n", "a, b"),
    ("x) + f(y)\n", ")\n", "x) + f(y"),  # the line's last ")" is the one the suffix already has
    ("x) + 1\n", ")\n", "x) + 1\n"),  # a ")" inside the line is not the rest of the line
    ("x = 1\nreturn y\nz", "return y\n", "x = 1\n"),  # cursor at a line start, suffix on the same line
    ("anything\n", "", "anything\n"),
    ("anything\n", "\n\n  \n", "anything\n"),  # a blank suffix has nothing to run into
    ("    return 1\n    return 2\n", "    return 2\n", "    return 1\n"),
]


@pytest.mark.parametrize("completion, suffix, trimmed", TRIM_CASES)
def test_trim_to_suffix(completion, suffix, trimmed):
    assert trim_to_suffix(completion, suffix) == trimmed


@pytest.mark.parametrize("completion, suffix, trimmed", TRIM_CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streaming_trim_sends_only_what_stays(completion, suffix, trimmed, piece):
    out = OutputFilter([SuffixTrimmer(suffix)])
    sent = ""
    for start in range(0, len(completion), piece):
        delta, stop = out.feed(completion[start : start + piece])
        sent += delta
        assert trimmed.startswith(sent), "sent text was taken back"
        if stop:
            break
    sent += out.finish()
    assert sent == trimmed
