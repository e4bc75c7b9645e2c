"""Graceful shutdown: SIGTERM drains `vllm serve` (new requests get a 503 with Retry-After,
running requests finish, and the shutdown timeout or a second signal ends the rest with an
error event and [DONE]); the server exits cleanly and leaves no socket directory behind."""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import pytest
import uvicorn

from tests.utils_wait import wait_until
from vllm.entrypoints.openai.drain import SHUTDOWN_REASON, DrainingServer

from .conftest import RemoteServer

MODEL = "demo-tiny"
WAIT_S = 120


class Stream(threading.Thread):
    """A streaming completion read line by line in the background."""

    def __init__(self, server: RemoteServer, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.max_tokens = max_tokens
        self.events: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.server.url("/v1/completions"), json=body,
                          timeout=WAIT_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: "):])
                    self.started.set()

    def payloads(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


@pytest.mark.slow
def test_sigterm_drains_then_a_second_signal_ends_the_rest(tmp_path) -> None:
    server = RemoteServer([MODEL, "--max-model-len", "4096", "--shutdown-timeout", "600"],
                          env={"TMPDIR": str(tmp_path)})
    try:
        long_streams = [Stream(server, 4000) for _ in range(2)]
        short = Stream(server, 40)
        for stream in [*long_streams, short]:
            stream.start()
            assert stream.started.wait(WAIT_S), server.log()
        server.proc.send_signal(signal.SIGTERM)

        # Draining: a new generation request is refused at once, with a hint to retry.
        def refused() -> bool:
            r = httpx.post(server.url("/v1/completions"), timeout=WAIT_S,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
            return r.status_code == 503
        assert wait_until(refused, WAIT_S), "no 503 while draining"
        r = httpx.post(server.url("/v1/completions"), timeout=WAIT_S,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["Retry-After"]
        assert "shutting down" in r.json()["error"]["message"]
        # A load balancer polling /health takes the server out of rotation now, not after
        # the drain.
        health = httpx.get(server.url("/health"), timeout=WAIT_S)
        assert health.status_code == 503 and "draining" in health.json()["error"]["message"]

        # A running request finishes normally within the drain.
        short.join(WAIT_S)
        assert short.events[-1] == "[DONE]"
        assert short.payloads()[-1]["choices"][0]["finish_reason"] == "length"
        assert all(s.is_alive() for s in long_streams), "the long requests ended early"

        # A second signal ends what still runs: an error event, then [DONE].
        server.proc.send_signal(signal.SIGTERM)
        for stream in long_streams:
            stream.join(WAIT_S)
            assert stream.events[-1] == "[DONE]", stream.events[-3:]
            assert "error" in stream.payloads()[-1], stream.events[-3:]
        assert server.proc.wait(WAIT_S) == 0
        log = server.log()
        assert "Traceback" not in log and "CancelledError" not in log, log
        assert not list(tmp_path.glob("vllm-*")), "a socket directory was left behind"
    finally:
        server.stop()


class FakeEngine:
    """Requests that finish one per poll (or never), and the failures the drain causes."""

    def __init__(self, running: int, finishing: bool) -> None:
        self.running = running
        self.finishing = finishing
        self.failed: list[tuple[int, str]] = []

    @property
    def num_unfinished_requests(self) -> int:
        if self.finishing and self.running:
            self.running -= 1
        return self.running

    def fail_requests(self, reason: str) -> None:
        self.failed.append((self.running, reason))
        self.running = 0


class FakeGate:
    draining = False


def drain_with(engine: FakeEngine, timeout_s: float) -> tuple[DrainingServer, list[float]]:
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0  # each look at the clock is one second later
        return now[0]

    gate = FakeGate()
    server = DrainingServer(uvicorn.Config(app=None), engine, gate, timeout_s, clock=clock)
    asyncio.run(server.drain())
    assert gate.draining and server.should_exit
    return server, now


def test_the_drain_waits_for_running_requests_to_finish() -> None:
    engine = FakeEngine(running=3, finishing=True)
    drain_with(engine, timeout_s=100)
    assert engine.failed == [(0, SHUTDOWN_REASON)]  # nothing was left to end


def test_the_drain_ends_running_requests_after_the_shutdown_timeout() -> None:
    engine = FakeEngine(running=2, finishing=False)
    _, now = drain_with(engine, timeout_s=5)
    assert engine.failed == [(2, SHUTDOWN_REASON)]
    assert 5 <= now[0] <= 8  # it stopped waiting at the deadline, not before or long after


def test_a_zero_timeout_ends_running_requests_at_once() -> None:
    engine = FakeEngine(running=1, finishing=False)
    _, now = drain_with(engine, timeout_s=0)
    assert engine.failed == [(1, SHUTDOWN_REASON)]
    assert now[0] <= 2
