"""`codespec lsp` on the default model, over stdio: a block completion that stops at the end of its block, and
a rewrite command whose edit is exactly what plain greedy decoding writes, drafted by the edit-aligned drafter."""

import sys

import pytest
import pytest_lsp
from lsprotocol import types
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities

from codespec.config import SamplingParams, SpecConfig
from codespec.context.treesitter import indent_of
from lsp import commands, prompts
from lsp.protocol import REWRITE_SELECTION, SETTINGS_SECTION

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SOURCE = '''import math


def circle_area(radius):
    """The area of a circle."""
    return math.pi * radius * radius


def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    
'''
RANGE = types.Range(start=types.Position(line=8, character=0), end=types.Position(line=13, character=0))  # mean()


@pytest_lsp.fixture(scope="module", config=ClientServerConfig(
    server_command=[sys.executable, "-m", "codespec", "lsp", "--dtype", "float32"]))
async def client(lsp_client: LanguageClient):
    lsp_client.applied_edits = []

    @lsp_client.feature(types.WORKSPACE_APPLY_EDIT)
    def apply_edit(params: types.ApplyWorkspaceEditParams):
        lsp_client.applied_edits.append(params)
        return types.ApplyWorkspaceEditResult(applied=True)

    await lsp_client.initialize_session(types.InitializeParams(
        capabilities=client_capabilities("neovim"),
        initialization_options={SETTINGS_SECTION: {"debounce_ms": 0, "max_tokens": 64, "command_max_tokens": 160}}))
    lsp_client.text_document_did_open(types.DidOpenTextDocumentParams(types.TextDocumentItem(
        uri="file:///work/stats.py", language_id="python", version=1, text=SOURCE)))
    yield
    await lsp_client.shutdown_session()


async def test_a_block_completion_stops_at_the_end_of_its_block(client: LanguageClient):
    result = await client.text_document_inline_completion_async(types.InlineCompletionParams(
        text_document=types.TextDocumentIdentifier("file:///work/stats.py"), position=types.Position(16, 4),
        context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked)))
    (item,) = result.items
    assert item.range.start == item.range.end == types.Position(line=16, character=4)
    lines = item.insert_text.split("\n")
    assert lines[0].strip(), item.insert_text  # code on the cursor's line
    assert all(indent_of(line) >= 4 for line in lines[1:] if line.strip()), item.insert_text  # inside variance()


async def test_a_rewrite_is_exactly_plain_greedy_and_drafted_from_the_selection(client: LanguageClient,
                                                                                 default_engine):
    arguments = [{"uri": "file:///work/stats.py", "range": client.protocol._converter.unstructure(RANGE),
                  "instruction": "rename the variable total to running_sum"}]
    result = await client.workspace_execute_command_async(types.ExecuteCommandParams(
        command=REWRITE_SELECTION.id, arguments=arguments))
    assert result["applied"] is True
    (edit,) = client.applied_edits
    (change,) = edit.edit.changes["file:///work/stats.py"]  # neovim takes plain changes
    assert change.range == RANGE

    # the same prompt, decoded plainly in this process
    selection = SOURCE[SOURCE.index("def mean"): SOURCE.index("def variance")].rstrip("\n") + "\n"
    values = {"uri": arguments[0]["uri"], "range": None, "instruction": arguments[0]["instruction"]}
    ids, _ = prompts.build_prompt(default_engine, REWRITE_SELECTION.id, values, selection, "python")
    plain = default_engine.generate(ids, SamplingParams(max_tokens=160, stop=(prompts.FENCE,)),
                                    spec=SpecConfig(spec=("none",)))
    assert change.new_text == commands.fit_to_selection(plain.text, selection)
    assert result["stats"]["tokens_per_forward"] > 1.5  # most of the rewrite was drafted, not decoded one by one
