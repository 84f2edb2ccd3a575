"""llama-server's tokenizer routes: /tokenize, /detokenize and /apply-template (the chat template applied, as text,
without generating). They run on the engine's worker, as prompts are built: the tokenizer is the engine's."""

from __future__ import annotations

from fastapi import APIRouter
from jinja2 import TemplateError

from ...errors import CodespecError
from ..errors import LLAMA_CPP_ERRORS, Unsupported
from ..llamacpp import pieces
from ..schemas import (ApplyTemplateRequest, ApplyTemplateResponse, ChatMessage, DetokenizeRequest,
                       DetokenizeResponse, TokenizeRequest, TokenizeResponse)
from ..state import Server

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses=LLAMA_CPP_ERRORS)
async def tokenize(body: TokenizeRequest, server: Server):
    """The text's token ids (`with_pieces`: each with its text); `add_special` adds the special tokens a prompt
    gets (BOS), `parse_special: false` reads special tokens' text as plain text."""
    def run(engine):
        ids = list(engine.tokenizer(body.content, add_special_tokens=body.add_special,
                                    split_special_tokens=not body.parse_special).input_ids)
        return {"tokens": pieces(engine.tokenizer, ids) if body.with_pieces else ids}
    return await server.scheduler.acall(run)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=LLAMA_CPP_ERRORS)
async def detokenize(body: DetokenizeRequest, server: Server):
    """The tokens' text, special tokens included (as llama-server spells them)."""
    def run(engine):
        vocabulary = len(engine.tokenizer)
        outside = next((token for token in body.tokens if token >= vocabulary), None)
        if outside is not None:
            raise Unsupported("tokens", f"token id {outside} is outside the vocabulary (0..{vocabulary - 1})")
        return {"content": engine.tokenizer.decode(body.tokens, skip_special_tokens=False,
                                                   clean_up_tokenization_spaces=False)}
    return await server.scheduler.acall(run)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Chat messages as the template takes them (OpenAI's `developer` is the template's `system`), as
    /v1/chat/completions passes them."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


@router.post("/apply-template", response_model=ApplyTemplateResponse, responses=LLAMA_CPP_ERRORS)
async def apply_template(body: ApplyTemplateRequest, server: Server):
    """The model's chat template applied to the messages, with the assistant's generation prompt: the text
    /v1/chat/completions would continue (send it to /completion, changed or not)."""
    messages = template_messages(body.messages)

    def run(engine):
        if not getattr(engine.tokenizer, "chat_template", None):
            raise CodespecError("this model has no chat template")
        try:
            prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:  # a template that refuses these messages (e.g. roles that must alternate)
            raise CodespecError(f"the chat template refused the messages: {exc}") from None
        return {"prompt": prompt}
    return await server.scheduler.acall(run)
