"""The refactoring commands' prompts: the chat message that asks for the rewritten code, primed with an opening
code fence. Both backends build them here (LocalBackend on the engine's thread, RemoteBackend as chat text for a
codespec server), and commands.py runs the commands."""

from __future__ import annotations

from .protocol import ADD_DOCSTRINGS, ADD_TYPE_HINTS, REWRITE_SELECTION, TRANSLATE_COMMENTS

# The request names the change after the code's language and asks for the complete code back, and the
# model's own system prompt stays: with SmolLM2-135M, a custom system prompt or the instruction after the
# code made it loop on the docstring instead of copying the function (measured on stdlib functions).
TASKS = {
    REWRITE_SELECTION.id: "following this instruction: {instruction}",
    ADD_DOCSTRINGS.id: "adding a docstring to every function and class",
    ADD_TYPE_HINTS.id: "adding type hints to every function signature",
    TRANSLATE_COMMENTS.id: "translating every comment and docstring into {language}",
}
LANGUAGE_NAMES = {"javascript": "JavaScript", "typescript": "TypeScript", "cpp": "C++", "csharp": "C#"}
FENCE = "```"


def request_text(command_id: str, values: dict, selection: str, language: str) -> tuple[str, str]:
    """(the user's chat message, the start of the answer it is primed with: an opening code fence)."""
    task = TASKS[command_id].format(**values)
    name = LANGUAGE_NAMES.get(language, language.capitalize()) if language else "this"
    user = f"Rewrite this {name} code, {task}. Reply with the complete code only.\n\n" \
           f"{FENCE}{language}\n{selection.rstrip()}\n{FENCE}"
    return user, f"{FENCE}{language}\n"


def build_prompt(engine, command_id: str, values: dict, selection: str, language: str) -> tuple[list[int], list[int]]:
    """On the engine's thread: (prompt ids primed with an opening fence, the selection's tokens)."""
    user, primer = request_text(command_id, values, selection, language)
    ids = engine.encode(user, chat=True) + encode(engine, primer)
    return ids, encode(engine, selection)


def encode(engine, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=False).input_ids)
