"""Tests for vllm/entrypoints/openai/stalled_send.py: a client that stops reading is dropped
once a write has waited the send timeout, and its response's work ends; a reading client is
never dropped."""

from __future__ import annotations

import asyncio
import logging

import pytest
from starlette.responses import JSONResponse, StreamingResponse

from tests.utils_wait import wait_until
from vllm.entrypoints.openai.stalled_send import StalledSendGuard

TIMEOUT_S = 0.05
# A bound on how long a check may take before it counts as hung (not a speed requirement).
HUNG_S = 30.0


class Client:
    """An ASGI client that reads `reads` body messages, then stops reading (its writes never
    complete) but keeps the connection open (it never disconnects)."""

    def __init__(self, reads: int | None) -> None:
        self.reads = reads
        self.bodies: list[bytes] = []

    async def receive(self) -> dict:
        await asyncio.Event().wait()  # the client sends nothing more and never leaves
        raise AssertionError("unreachable")

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.body":
            if self.reads is not None and len(self.bodies) >= self.reads:
                await asyncio.Event().wait()
            self.bodies.append(message.get("body", b""))


SCOPE = {"type": "http", "path": "/v1/completions", "headers": [],
         "asgi": {"version": "3.0", "spec_version": "2.3"}}


def run(app, client: Client) -> None:
    guarded = StalledSendGuard(app, timeout_s=TIMEOUT_S)
    asyncio.run(asyncio.wait_for(guarded(dict(SCOPE), client.receive, client.send), HUNG_S))


def endless_stream(state: dict) -> StreamingResponse:
    async def events():
        try:
            while True:
                state["sent"] += 1
                yield b"data: {}\n\n"
                await asyncio.sleep(0)
        finally:
            state["closed"] = True  # where the route aborts its engine requests

    return StreamingResponse(events(), media_type="text/event-stream")


def test_a_stream_to_a_client_that_stopped_reading_ends(caplog) -> None:
    state = {"sent": 0, "closed": False}
    client = Client(reads=3)
    with caplog.at_level(logging.WARNING, logger="vllm.entrypoints.openai.stalled_send"):
        run(endless_stream(state), client)
    assert state["closed"]
    assert len(client.bodies) == 3
    assert any("read nothing" in r.getMessage() for r in caplog.records)


def test_a_whole_response_to_a_client_that_never_reads_ends() -> None:
    client = Client(reads=0)
    run(JSONResponse({"x": "y" * 1000}), client)
    assert client.bodies == []


def test_a_reading_client_gets_everything() -> None:
    async def chunks():
        for i in range(50):
            yield f"data: {i}\n\n".encode()

    client = Client(reads=None)
    run(StreamingResponse(chunks(), media_type="text/event-stream"), client)
    assert b"".join(client.bodies) == b"".join(f"data: {i}\n\n".encode() for i in range(50))


@pytest.mark.parametrize("scope_type", ["lifespan", "websocket"])
def test_other_scopes_pass_through(scope_type) -> None:
    seen = []

    async def app(scope, receive, send):
        seen.append((scope["type"], receive, send))

    async def receive():
        return {}

    async def send(message):
        pass

    asyncio.run(StalledSendGuard(app, TIMEOUT_S)({"type": scope_type}, receive, send))
    assert seen == [(scope_type, receive, send)]


def test_no_task_is_left_pending_after_a_response() -> None:
    """The disconnect listener is cancelled when a stream ends; the tasks the guard made to
    wait for the client must end with it (else each request logs 'Task was destroyed but
    it is pending!' when they are collected)."""
    async def chunks():
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    async def run_and_list_pending() -> list[asyncio.Task]:
        client = Client(reads=None)
        guarded = StalledSendGuard(StreamingResponse(chunks()), timeout_s=HUNG_S)
        await guarded(dict(SCOPE), client.receive, client.send)
        await asyncio.sleep(0)  # let cancellations run
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(run_and_list_pending()) == []


class Records(logging.Handler):
    """Keeps every record of the loggers it is attached to."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_drop_under_uvicorn_logs_one_warning_and_no_error() -> None:
    """Through uvicorn configured as `vllm serve` runs it, and a real socket: a client that
    sends a request and never reads is dropped with our one warning, and uvicorn logs no
    error about the response left unfinished (it sees a client gone, not an app that
    failed)."""
    import socket
    import threading

    import uvicorn

    from vllm.entrypoints.openai.api_server import ServerOptions, uvicorn_config

    state = {"sent": 0, "returned": False}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return  # nothing to start or stop
        # Chunks big enough to fill the socket buffers of a client that does not read, made
        # without ever waiting (the drop must end even such a stream).
        async def chunks():
            while True:
                state["sent"] += 1
                yield b"x" * 65536

        try:
            await StreamingResponse(chunks())(scope, receive, send)
        finally:
            state["returned"] = True

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    config = uvicorn_config(StalledSendGuard(app, timeout_s=0.5), ServerOptions())
    # After the config, which sets up uvicorn's loggers (removing handlers found on them).
    records = Records()
    loggers = [logging.getLogger("uvicorn.error"),
               logging.getLogger("vllm.entrypoints.openai.stalled_send")]
    for log in loggers:
        log.addHandler(records)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        assert wait_until(lambda: server.started, HUNG_S, 0.01), "uvicorn did not start"
        client.connect(("127.0.0.1", port))
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        # The client reads nothing. Wait (bounded) until the app has returned and uvicorn has
        # finished the request's task, i.e. until everything it logs about it is logged.
        assert wait_until(lambda: state["returned"] and not server.server_state.tasks,
                          HUNG_S, 0.01), "the stalled response was never dropped"
    finally:
        server.should_exit = True
        thread.join(HUNG_S)
        client.close()
        for log in loggers:
            log.removeHandler(records)
    assert state["sent"] > 1
    errors = [r.getMessage() for r in records.records if r.levelno >= logging.ERROR]
    assert errors == []
    warnings = [r.getMessage() for r in records.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "read nothing" in warnings[0], warnings
