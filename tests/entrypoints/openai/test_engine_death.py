"""When the engine-core process dies, the server says so at once and nothing hangs."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from .conftest import alive_after, descendants

MODEL = "demo-tiny"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(MODEL, "--max-model-len", "512", "--disable-log-requests")


def test_engine_death_fails_fast(server):
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    events: list[str] = []
    first_chunk = threading.Event()
    done = threading.Event()

    def stream_forever() -> None:
        body = {"model": MODEL, "prompt": "go", "max_tokens": 500, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    first_chunk.set()
        done.set()

    thread = threading.Thread(target=stream_forever, daemon=True)
    thread.start()
    assert first_chunk.wait(60)
    os.kill(server.engine_pid, signal.SIGKILL)

    # The open stream ends with an error event, then [DONE].
    assert done.wait(10), "the stream did not end after the engine died"
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "engine" in error["message"]
    # One clean line: no traceback, no terminal escapes.
    for marker in ("Traceback", "\x1b[", "\\u001b", "\\n"):
        assert marker not in events[-2], events[-2]

    # Health and new requests fail at once with 5xx in OpenAI's shape.
    r = httpx.get(server.url("/health"), timeout=10)
    assert r.status_code == 503
    assert "Traceback" not in r.text and "\x1b[" not in r.text and "\\n" not in r.text
    for path, body in [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "stream": True}),
    ]:
        # The client timeout is a hang check: the answer needs no engine, so none is waited for.
        r = httpx.post(server.url(path), json=body, timeout=30)
        assert r.status_code == 503
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    m = server.metrics()
    assert m["vllm:engine_alive"] == 0.0
    assert m["vllm:num_requests_api_server"] == 0
    # Bad requests are still 4xx (validation runs before the engine is needed).
    r = httpx.post(server.url("/v1/completions"), content=b"{", timeout=10)
    assert r.status_code == 400

    # The server still shuts down cleanly, leaving nothing behind.
    children = descendants(server.proc.pid)
    assert server.stop(signal.SIGTERM, timeout_s=30) == 0
    assert alive_after(children) == []
