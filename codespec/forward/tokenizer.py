"""A tokenizer that transformers saved as its own fast class (`TokenizersBackend`: a tokenizer.json, as the default
model's is), read with the `tokenizers` library and its chat template rendered with jinja2, without transformers.

Importing transformers takes ~1 s of every start (it reads its every model's source files to build its lazy
namespace), more than a second `codespec generate` spends generating; a GGUF read directly needs nothing else of
it. `SavedTokenizer` answers what codespec asks of a tokenizer (calling it, decode, the vocabulary and its special
tokens, the chat template) as transformers' class answers it: tests/unit/test_tokenizer.py checks them side by side.

The chat template is untrusted code from the model file: it runs in jinja2's immutable sandbox with what
transformers' renderer gives a template (`tojson`, `raise_exception`, `strftime_now`, loop controls, a
`{% generation %}` block, namespaces that refuse underscore names), and messages are plain JSON values."""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path

from tokenizers import Tokenizer

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def readable(folder: Path) -> bool:
    """Whether `folder` holds a tokenizer saved as transformers' fast class (what SavedTokenizer reads)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("tokenizer_class") == "TokenizersBackend" and (folder / "tokenizer.json").is_file()


class SavedTokenizer:
    """transformers' fast tokenizer as saved in a folder, read without transformers."""

    def __init__(self, folder: Path):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        self.backend_tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.name_or_path = str(folder)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map = {name: _content(config[name]) for name in NAMED if config.get(name) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = extra.values() if isinstance(extra, dict) else extra
        self.extra_special_tokens = [_content(token) for token in extra]
        if self.extra_special_tokens:
            self.special_tokens_map["additional_special_tokens"] = list(self.extra_special_tokens)
        template = folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else config.get("chat_template")
        for name in NAMED:
            token = self.special_tokens_map.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else self.backend_tokenizer.token_to_id(token))
        # the named special tokens, then the extra ones, each once (transformers' order); fixed once saved
        named = [self.special_tokens_map[name] for name in NAMED if name in self.special_tokens_map]
        self.all_special_tokens = list(dict.fromkeys(named + self.extra_special_tokens))
        self.all_special_ids = [self.backend_tokenizer.token_to_id(token) for token in self.all_special_tokens]

    # ---- the vocabulary

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without the added tokens."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skipped = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skipped]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(token) for token in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend_tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    # ---- text to tokens and back

    def __call__(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> "Encoding":
        """`text`'s tokens as `input_ids` (what codespec reads of transformers' BatchEncoding)."""
        return Encoding(input_ids=self.encode(text, add_special_tokens, split_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """split_special_tokens: a special token's text in `text` is tokenized as text, not as that token."""
        self.backend_tokenizer.encode_special_tokens = split_special_tokens
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        """(transformers cleans up spaces only for WordPiece-like models: never for BPE, the GGUF tokenizers' model.)"""
        ids = [ids] if isinstance(ids, int) else list(ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        if clean_up_tokenization_spaces and type(self.backend_tokenizer.model).__name__ != "BPE":
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    # ---- chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = False, **kwargs):
        """The chat template rendered for `messages` (a string), or with tokenize its tokens (a list; with
        return_dict, {"input_ids": tokens}). A template that refuses the messages raises jinja2's TemplateError."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        text = _compiled(self.chat_template).render(
            messages=[_message(m) for m in _plain(list(messages))], tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **_plain(self.special_tokens_map | kwargs))
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids


class Encoding(dict):
    """{"input_ids": [...]}, its keys also attributes, as transformers' BatchEncoding gives them."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _content(token) -> str:
    """A special token's text, saved as a string or as an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else str(token)


REASONING = ("reasoning_content", "thinking", "reasoning")  # the names a message's reasoning comes under


def _message(message) -> dict:
    """A message as transformers hands it to a template: its keys with a value (OpenAI's clients send
    `"content": null`), its reasoning under each name templates read."""
    if not isinstance(message, dict):
        raise TypeError(f"a chat message must be an object, not {message!r}")
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value):
    """`value` rebuilt of JSON's types (the template sees nothing with methods of its own)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    for kind in (str, bool, int, float):
        if isinstance(value, kind):
            return kind(value)
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled in the sandbox (kept: a server renders one template per request)."""
    return _environment().from_string(template)


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: its body, rendered in place (transformers marks which tokens it
        wrote for training masks; a prompt needs only the text)."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing the underscore names through which a template could reach Python's internals."""

        def __init__(*args, **kwargs):
            self, fields = args[0], dict(*args[1:], **kwargs)
            for name in fields:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, fields)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson

    class Dict:
        """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    environment.globals.update(raise_exception=raise_exception, namespace=Namespace, dict=Dict(),
                               strftime_now=lambda form: datetime.datetime.now().strftime(form))
    return environment
