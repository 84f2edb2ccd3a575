"""Fill-in-the-middle prompts: the model's own FIM tokens when it has them, prefix-only completion when not.

Formats are detected from the tokenizer's vocabulary, never from the model's name:

  family     prefix / suffix / middle                               repo-level (extra files)
  qwen       <|fim_prefix|> <|fim_suffix|> <|fim_middle|>           <|repo_name|> <|file_sep|>
  starcoder  <fim_prefix> <fim_suffix> <fim_middle>  (SmolLM too)   <repo_name> (or <reponame>) <file_sep>
  codellama  <PRE> <SUF> <MID>  (spelt ▁<PRE> in HF vocabularies)   -
  deepseek   <｜fim▁begin｜> <｜fim▁hole｜> <｜fim▁end｜>  (full-width bars, U+FF5C, and ▁ U+2581)   -

The layout follows llama.cpp's /infill (tools/server, format_infill): the extra files first, each as
`<file_sep>filename\\ntext` after `<repo_name>myproject\\n` (or separated by a `--- snippet ---` line when the
model has no file separator), then `<file_sep>filename\\n` for the current file, then
`<fim_prefix>prefix<fim_suffix>suffix<fim_middle>`. The text typed before the cursor on its line (llama.cpp's
`prompt`) belongs to the prefix. One difference: a beginning-of-sequence token goes first, before the extra
files, where the model saw it in training (llama.cpp puts it after them).

Text pieces are tokenised with special tokens split, so a file that contains the text `<|endoftext|>` or
`<fim_middle>` stays text and cannot end or reshape the prompt.

The default model, SmolLM2-135M-Instruct, has no FIM tokens: its vocabulary starts with <|endoftext|>,
<|im_start|>, <|im_end|>, <repo_name>, <reponame>, <file_sep>, <filename>, ... and `<fim_prefix>` is not in
it at all (it tokenises as eight ordinary pieces, and the model answers such a prompt with prose about the
code). So it gets the fallback: complete from the prefix and cut the completion where it runs into the suffix
(`trim_to_suffix`). Its <repo_name> and <file_sep> are real special tokens from its code pretraining, and with
them an extra file visibly conditions the completion (it reuses the extra file's names and style), so the
fallback keeps the repo-level layout for extra files when a model has <file_sep>.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..healing import heal

REPO_NAME = "myproject"  # what llama.cpp writes after <repo_name>; models only see it as a name
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks when the model has no file separator
CURRENT_FILE = "filename"  # llama.cpp's name for the current file when the client sends none
UNLIMITED_ROOM = 256  # context kept free for the text when a request sets no limit (generation ends at the context)

# family: (prefix, suffix, middle), repo-name spellings, file-separator spellings, tokens that end a middle
FAMILIES = {
    "qwen": (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<|repo_name|>",),
             ("<|file_sep|>", "<|file_separator|>"), ("<|fim_pad|>", "<|endoftext|>", "<|im_end|>")),
    "starcoder": (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<repo_name>", "<reponame>"),
                  ("<file_sep>",), ("<fim_pad>", "<|endoftext|>")),
    "codellama": (("▁<PRE>", "▁<SUF>", "▁<MID>"), (), (), ("▁<EOT>",)),
    "codellama-plain": (("<PRE>", "<SUF>", "<MID>"), (), (), ("<EOT>",)),
    "deepseek": (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), (), (),
                 ("<|EOT|>", "<｜end▁of▁sentence｜>")),
}
# what repo-level layout the fallback may use for a model without FIM tokens
FALLBACK_REPO = ("<repo_name>", "<|repo_name|>", "<reponame>")
FALLBACK_SEP = ("<file_sep>", "<|file_sep|>", "<|file_separator|>")


@dataclass(frozen=True)
class FimFormat:
    name: str  # the family, as in FAMILIES
    prefix: int  # token ids
    suffix: int
    middle: int
    repo: int | None = None  # repo-level layout, when the model has it
    file_sep: int | None = None
    stop_ids: frozenset[int] = frozenset()  # tokens that end the middle (besides the model's EOS)


@dataclass
class FimPrompt:
    ids: list[int]
    format: FimFormat | None  # None: prefix-only completion; trim the output with trim_to_suffix
    extra_used: int = 0  # extra chunks that fit
    truncated: bool = False  # something (extra chunks, the start of the prefix, the end of the suffix) was cut
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    healed: str | None = None  # the prefix's last token string, moved into the output (token healing)


def _token(vocab: dict, spellings) -> int | None:
    for spelling in spellings:
        if spelling in vocab:
            return vocab[spelling]
    return None


def vocab_of(tokenizer) -> dict[str, int]:
    """tokenizer.get_vocab(), kept: building it takes ~27 ms for the default model's 49,152 tokens, once per request
    before (on the engine's thread, ahead of every other session's next forward). Keyed on the vocabulary's size
    too, so a tokenizer that gains tokens is read again."""
    return _vocabulary(tokenizer, len(tokenizer))


@functools.lru_cache(maxsize=16)
def _vocabulary(tokenizer, size: int) -> dict[str, int]:
    return tokenizer.get_vocab()


def detect_fim(tokenizer) -> FimFormat | None:
    """The model's FIM format, from the special tokens in its vocabulary; None when it has none."""
    vocab = vocab_of(tokenizer)
    for name, (fim, repos, seps, stops) in FAMILIES.items():
        ids = [vocab.get(token) for token in fim]
        if None in ids:
            continue
        return FimFormat(name.removesuffix("-plain"), *ids, repo=_token(vocab, repos), file_sep=_token(vocab, seps),
                         stop_ids=frozenset(vocab[s] for s in stops if s in vocab))
    return None


def _encode(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    try:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)
    except TypeError:  # a tokenizer without split_special_tokens
        return list(tokenizer(text, add_special_tokens=False).input_ids)


def _bos(tokenizer) -> list[int]:
    """The beginning-of-sequence token when the tokenizer adds one to every text (CodeLlama, DeepSeek)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    added = tokenizer("", add_special_tokens=True).input_ids
    return [bos] if added[:1] == [bos] else []


def _extra_chunks(tokenizer, extra, repo: int | None, file_sep: int | None, filename: str | None):
    """(head, chunks, tail): the repo header, one token list per extra file, and the current file's header."""
    head = [repo] + _encode(tokenizer, REPO_NAME + "\n") if repo is not None and file_sep is not None else []
    chunks = []
    for name, text in extra:
        if file_sep is not None:
            chunks.append([file_sep] + _encode(tokenizer, (name or "tmp") + "\n") + _encode(tokenizer, text))
        else:
            chunks.append(_encode(tokenizer, SNIPPET_SEPARATOR) + _encode(tokenizer, text))
    tail = [file_sep] + _encode(tokenizer, (filename or CURRENT_FILE) + "\n") if file_sep is not None else []
    return head, chunks, tail


def fim_prompt(tokenizer, prefix: str, suffix: str, extra=(), filename: str | None = None,
               max_tokens: int | None = None, fmt: FimFormat | None | bool = True, vocabulary=None) -> FimPrompt:
    """Prompt ids for filling the gap between prefix and suffix.

    extra: [(filename, text)] of other files or chunks, most relevant last (they sit nearest the cursor).
    max_tokens: the prompt budget; when it is exceeded, extra chunks go first (the oldest first), then the start of
    the prefix and the end of the suffix, three to one, as llama.cpp cuts them.
    fmt: True detects the format; None forces the prefix-only fallback; or a FimFormat.
    vocabulary: a healing.Vocabulary heals the cursor: a last prefix token that a longer one could extend (the bare
    newline of an empty line, half a name) leaves the prompt, and the output must spell it first (healed).
    """
    if fmt is True:
        fmt = detect_fim(tokenizer)
    bos = _bos(tokenizer)
    prefix_ids = _encode(tokenizer, prefix)
    if fmt is not None:
        suffix_ids = _encode(tokenizer, suffix)
        repo, file_sep, stops = fmt.repo, fmt.file_sep, fmt.stop_ids
    else:  # prefix-only: the suffix is not in the prompt; the output is cut where it runs into it
        suffix_ids = []
        vocab = vocab_of(tokenizer)
        repo, file_sep, stops = _token(vocab, FALLBACK_REPO), _token(vocab, FALLBACK_SEP), frozenset()
    head, chunks, tail = _extra_chunks(tokenizer, extra, repo, file_sep, filename)
    markers = 3 if fmt is not None else 0
    truncated = False
    if max_tokens is not None:
        fixed = len(bos) + len(head) + len(tail) + markers
        while chunks and fixed + sum(map(len, chunks)) + len(prefix_ids) + len(suffix_ids) > max_tokens:
            chunks.pop(0)
            truncated = True
        room = max_tokens - fixed - sum(map(len, chunks))
        if len(prefix_ids) + len(suffix_ids) > room:
            truncated = True
            suffix_room = min(len(suffix_ids), max(room // 4, room - len(prefix_ids)))
            suffix_ids = suffix_ids[: max(suffix_room, 0)]
            prefix_ids = prefix_ids[len(prefix_ids) - max(room - len(suffix_ids), 0):]
    context = bos + head + [t for chunk in chunks for t in chunk] + tail
    healed = None
    if vocabulary is not None:
        prefix_ids, healed = heal(vocabulary, prefix_ids, 0)
    if fmt is None:
        ids = context + prefix_ids
    else:
        ids = context + [fmt.prefix] + prefix_ids + [fmt.suffix] + suffix_ids + [fmt.middle]
    return FimPrompt(ids, fmt, len(chunks), truncated, stops, healed)


def prompt_budget(context_length: int, max_tokens: int, limited: bool = True) -> int:
    """The tokens a prompt may take (fim_prompt's max_tokens), for every frontend: the context less room for the
    output (`max_tokens`) and one token, but at least half the context, so a long output limit never squeezes the
    prompt to nothing (the output then ends where the context does). limited=False: the request set no limit (its
    max_tokens is the rest of the context), so only a little room is kept, UNLIMITED_ROOM."""
    room = max_tokens if limited else min(max_tokens, UNLIMITED_ROOM)
    return max(context_length - room - 1, context_length // 2)


def trim_to_suffix(completion: str, suffix: str) -> str:
    """Cut a prefix-only completion where its text runs into the suffix (the code after the cursor).

    The suffix's first non-blank line is the anchor: the completion ends before the first place where it writes
    that line again (compared without surrounding whitespace), and blank lines it wrote just before it go too when
    the suffix starts with its own line break. When the cursor is mid-line, a first line that ends with the rest of
    the cursor's line is cut before that rest. Otherwise the completion stands.
    """
    cut = _suffix_cut(completion, suffix, final=True)
    return completion if cut is None else completion[:cut]


def _suffix_cut(completion: str, suffix: str, final: bool) -> int | None:
    """Where trim_to_suffix cuts (None: nowhere yet). final=False looks only at complete lines, so a cut found
    while streaming never moves later."""
    lines = suffix.split("\n")
    anchor = next((line.strip() for line in lines if line.strip()), "")
    if not anchor:
        return None
    rest_of_line = lines[0].strip()
    first_end = completion.find("\n")
    if rest_of_line and (first_end != -1 or final):
        first = completion if first_end == -1 else completion[:first_end]
        if first.rstrip().endswith(rest_of_line):
            return len(first.rstrip()) - len(rest_of_line)
    offset = 0
    for line in completion.splitlines(keepends=True):
        complete = line.endswith("\n") or final
        if complete and line.strip() == anchor and (offset > 0 or not rest_of_line):
            cut = offset
            if suffix.startswith(("\n", "\r\n")):
                cut = len(completion[:cut].rstrip("\r\n"))
            return cut
        offset += len(line)
    return None


class SuffixTrimmer:
    """trim_to_suffix for a stream, as an output limit (request/limits.py): `cut(text)` is where the text ends (None:
    not yet known) and `safe(text)` how much of it is settled; everything up to `safe` is a prefix of
    trim_to_suffix(all the text), so nothing sent is ever taken back."""

    def __init__(self, suffix: str):
        self.suffix = suffix
        self.mid_line = bool(suffix.split("\n")[0].strip())  # the cursor's line goes on after the cursor

    def cut(self, text: str, final: bool = False) -> int | None:
        return _suffix_cut(text, self.suffix, final)

    def safe(self, text: str) -> int:
        if self.mid_line and "\n" not in text:
            return 0  # the first line may still end with the rest of the cursor's line
        # hold back the unfinished last line (it may be the anchor) and trailing line breaks (a cut may drop them)
        safe = text.rfind("\n") + 1
        while safe > 0 and text[safe - 1] in "\r\n":
            safe -= 1
        return safe
