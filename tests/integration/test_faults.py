"""`codespec serve` killed with SIGKILL in the middle of a stream, then started again on the same port and home: it
serves at once, and greedy output is what it was before the kill."""

import signal

import httpx
import pytest

from tests.serving import free_port, start_codespec_serve

pytestmark = pytest.mark.integration

PROMPT = "# Python: the greatest common divisor\ndef gcd(a, b):\n"


def test_sigkill_mid_stream_then_restart_serves_the_same_greedy_output():
    port = free_port()
    process, client = start_codespec_serve(port)
    try:
        before = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 32}).json()["choices"][0]["text"]
        long = {"prompt": PROMPT, "max_tokens": 2000, "stream": True, "session": "editor"}
        with pytest.raises(httpx.TransportError):  # the connection dies with the server
            with client.stream("POST", "/v1/completions", json=long) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        process.send_signal(signal.SIGKILL)  # after the first streamed piece
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        client.close()
        process.kill()
        process.stderr.close()

    process, client = start_codespec_serve(port)  # same port, same $CODESPEC_HOME (model and cost caches)
    try:
        again = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 32, "session": "editor"})
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == before
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=30)
        process.stderr.close()
