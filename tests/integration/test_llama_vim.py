"""llama.vim against a real `codespec serve` on the default model, with llama.vim's own request bodies.

The bodies mirror ggml-org/llama.vim's autoload/llama.vim (commit a1c8e6e, 2026-01-31): s:ring_update's cache
warm-up and llama#fim's completion to `endpoint_fim` (/infill), llama#inst's warm-up and llama#inst_send's
instruction to `endpoint_inst` (/v1/chat/completions). Its defaults: n_prefix 256 lines, n_suffix 64, n_predict 128,
t_max_prompt_ms 500, t_max_predict_ms 1000 (250 for a first request), ring_chunk_size 64 (chunks of 33 lines: half a
chunk, both ends included), and `model` sent as '' (its check `len("g:llama_config.model_fim") > 0` tests the
literal name, so it always sends the option's default, '').
"""

import json
import time
from pathlib import Path

import pytest

from codespec.bench.llama_vim import instruction_messages
from tests.serving import running_codespec_serve

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
N_PREFIX, N_SUFFIX, N_PREDICT, RING_CHUNK_SIZE = 256, 64, 128, 64
FIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]


@pytest.fixture(scope="module")
def server():
    with running_codespec_serve() as client:
        yield client


def ring_chunk(path: str, first_line: int) -> dict:
    """s:pick_chunk: half a ring chunk of a file's lines (Vim's a:text[l0:l1] includes l1), joined with a final
    newline; `time` is Vim's reltime(), a pair of numbers."""
    lines = (ROOT / path).read_text().splitlines()
    chunk = lines[first_line : first_line + RING_CHUNK_SIZE // 2 + 1]
    return {"text": "\n".join(chunk) + "\n", "time": [1763900000 + first_line, 250000], "filename": path}


RING = [ring_chunk("codespec/request/limits.py", 10), ring_chunk("codespec/context/fim.py", 20),
        ring_chunk("codespec/server/generation.py", 40), ring_chunk("codespec/config.py", 30)]


def fim_local(lines: list[str], pos_y: int, pos_x: int) -> tuple[str, str, str, int]:
    """s:fim_ctx_local for a first request (no previous suggestion); pos_y is 1-based, as getline's."""
    line_cur = lines[pos_y - 1]
    prefix_lines = lines[max(1, pos_y - N_PREFIX) - 1 : pos_y - 1]
    suffix_lines = lines[pos_y : min(len(lines), pos_y + N_SUFFIX)]
    if not line_cur.strip():
        indent, cur_prefix, cur_suffix = 0, "", ""
    else:
        indent = len(line_cur) - len(line_cur.lstrip())
        cur_prefix, cur_suffix = line_cur[:pos_x], line_cur[pos_x:]
    return "\n".join(prefix_lines) + "\n", cur_prefix, cur_suffix + "\n" + "\n".join(suffix_lines) + "\n", indent


def ring_update_request(extra: list[dict]) -> dict:
    """s:ring_update: "no samplers needed here"."""
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""], "model": ""}


def fim_request(prefix: str, middle: str, suffix: str, indent: int, extra: list[dict], first: bool) -> dict:
    """llama#fim's request."""
    return {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": middle,
            "n_predict": N_PREDICT, "stop": [], "n_indent": indent, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 250 if first else 1000, "response_fields": FIM_FIELDS,
            "model": ""}


def generated_tokens(client) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
               if line.startswith("codespec_generated_tokens_total"))


def slot(client, name: str) -> dict:
    return {s["session"]: s for s in client.get("/slots").json()}[name]


def fim_local_after(lines: list[str], pos_y: int, prev: list[str], indent: int) -> tuple[str, str, str, int]:
    """s:fim_ctx_local for the request llama.vim sends as soon as a suggestion is shown: the context as if the
    suggestion (`prev`, its lines) were accepted."""
    line_cur = lines[pos_y - 1] + prev[0] if len(prev) == 1 else prev[-1]
    prefix_lines = lines[max(1, pos_y - N_PREFIX + len(prev) - 1) - 1 : pos_y - 1]
    if len(prev) > 1:
        prefix_lines += [lines[pos_y - 1] + prev[0], *prev[1:-1]]
    suffix_lines = lines[pos_y : min(len(lines), pos_y + N_SUFFIX)]
    return "\n".join(prefix_lines) + "\n", line_cur, "\n" + "\n".join(suffix_lines) + "\n", indent


def test_fim_ring_warm_up_then_completions(server):
    """The ring's warm-up fills slot 0 and generates nothing; the completion that follows reuses the ring's tokens;
    its answer has exactly the response_fields llama.vim asks for; the request llama.vim sends as soon as the
    suggestion is shown (the context as if it were accepted) reuses the completion's cache."""
    before = generated_tokens(server)
    warm = server.post("/infill", json=ring_update_request(RING))
    assert warm.status_code == 200 and warm.json() == {}
    assert generated_tokens(server) == before
    warmed = slot(server, "slot-0")
    assert warmed["tokens"] > 400 and warmed["cached"] == warmed["tokens"] - 1

    # the buffer: a file with a new function's first line typed at its end, the cursor after it
    lines = (ROOT / "codespec/request/limits.py").read_text().splitlines() + [
        "", "", "def first_line(text: str) -> str:"]
    pos_y, pos_x = len(lines), len(lines[-1])
    prefix, middle, suffix, indent = fim_local(lines, pos_y, pos_x)
    body = server.post("/infill", json=fim_request(prefix, middle, suffix, indent, RING, first=True))
    assert body.status_code == 200, body.text
    answer = body.json()
    assert set(answer) == set(FIM_FIELDS) and answer["content"].strip()
    assert answer["tokens_cached"] >= 0.9 * warmed["cached"], "the ring's warm-up was not reused"
    assert 0 < answer["timings/predicted_n"] <= N_PREDICT and answer["truncated"] is False
    prompt_tokens = answer["tokens_cached"] + answer["timings/prompt_n"]

    prev = answer["content"].split("\n")
    follow = server.post("/infill", json=fim_request(*fim_local_after(lines, pos_y, prev, indent), RING,
                                                     first=False)).json()
    assert set(follow) == set(FIM_FIELDS)
    assert follow["tokens_cached"] >= 0.9 * prompt_tokens, "the suggestion after it recomputed its prompt"


def test_instruction_warm_up_generates_nothing_and_the_instruction_runs_to_its_end(server):
    """:LlamaInstruct on a 20-line selection: the warm-up (sent while the instruction is typed) was a 256-token
    generation (26-45 s here) that the instruction and the next /infill warm-up waited for, and the instruction was
    cut at 256 tokens. Now the warm-up only fills the slot's cache and the instruction, which sets no length limit,
    runs to the end of its text, reusing that cache."""
    lines = (ROOT / "codespec/request/limits.py").read_text().splitlines()
    l0 = next(i for i, line in enumerate(lines, 1) if line.startswith("class BlockLimit"))
    l1 = l0 + 19
    warm_messages = instruction_messages(lines, l0, l1, RING[:2], "")
    before = generated_tokens(server)
    started = time.perf_counter()
    warm = server.post("/v1/chat/completions", json={
        "id_slot": 0, "messages": warm_messages, "samplers": [], "n_predict": 0, "stream": False,
        "cache_prompt": True, "response_fields": [""], "model": ""})
    warm_seconds = time.perf_counter() - started
    assert warm.status_code == 200 and warm.json() == {}
    assert generated_tokens(server) == before, "the warm-up generated"
    warmed = slot(server, "slot-0")
    assert warmed["cached"] == warmed["tokens"] - 1

    request = {"id_slot": 0, "messages": instruction_messages(lines, l0, l1, RING[:2], "Add a short docstring."),
               "min_p": 0.1, "temperature": 0.1, "samplers": ["min_p", "temperature"], "stream": True,
               "cache_prompt": True, "model": ""}
    started, first_text, text, events = time.perf_counter(), None, "", []
    with server.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.status_code == 200
        for line in response.iter_lines():  # as s:inst_on_response reads them
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            events.append(event)
            delta = event.get("choices", [{}])[0].get("delta", {}).get("content")
            if isinstance(delta, str) and delta:
                first_text = first_text or time.perf_counter() - started
                text += delta
            if len(text) > 3000:  # far past 256 tokens: a small model may loop to the end of its context
                break
    print(f"\ninstruction warm-up {warm_seconds:.2f} s ({warmed['tokens']} tokens); instruction: first text after "
          f"{first_text:.2f} s, {len(text)} characters in {time.perf_counter() - started:.2f} s")
    assert text.strip()
    if events[-1].get("usage"):  # it ended by itself: at the end of its text, reusing the warm-up's cache
        assert events[-1]["choices"][0]["finish_reason"] == "stop", "the instruction was cut short"
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * warmed["cached"]
    else:  # it ran on: closing the stream ended it, hundreds of tokens past where 256 would have cut it
        deadline = time.monotonic() + 60
        while slot(server, "slot-0")["busy"]:
            assert time.monotonic() < deadline, "the closed stream kept generating"
            time.sleep(0.1)
        assert slot(server, "slot-0")["tokens"] - warmed["tokens"] > 256 + 64


def test_a_fim_warm_up_after_an_instruction_does_not_wait_for_a_generation(server):
    """The next ring update on slot 0 (the slot the first instruction used) waited 32 s behind the instruction's
    warm-up generation; now both warm-ups are prefills only, and the later one ends the earlier one."""
    lines = (ROOT / "codespec/request/limits.py").read_text().splitlines()
    before = generated_tokens(server)
    inst_warm = {"id_slot": 0, "messages": instruction_messages(lines, 20, 39, RING[2:], ""), "samplers": [],
                 "n_predict": 0, "stream": False, "cache_prompt": True, "response_fields": [""], "model": ""}
    assert server.post("/v1/chat/completions", json=inst_warm).json() == {}
    assert server.post("/infill", json=ring_update_request(RING[1:])).json() == {}
    assert generated_tokens(server) == before
