"""Graceful shutdown of the HTTP server: drain the requests in flight before uvicorn closes
the connections (docs/architecture.md §1, "Shutdown")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import uvicorn

logger = logging.getLogger(__name__)

SHUTDOWN_REASON = "the server is shutting down"


class Drainable(Protocol):
    """What the drain needs from the engine."""

    @property
    def num_unfinished_requests(self) -> int: ...

    def fail_requests(self, reason: str) -> None: ...


class Admission(Protocol):
    """What the drain needs from the request gate: a switch that refuses new requests."""

    draining: bool


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain in front of its own shutdown.

    The first SIGINT/SIGTERM stops admitting (new generation requests get a 503 with
    Retry-After), lets the running requests finish for up to `timeout_s` seconds, then ends
    the rest with an error (a stream gets an error event and [DONE]) and lets uvicorn close
    the connections, which by then have nothing left to send. A second signal ends the drain
    at once. The first signal is re-raised after shutdown, as uvicorn does.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        engine: Drainable,
        gate: Admission,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.gate = gate
        self.timeout_s = timeout_s
        self.clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        """Serves until a drain (or uvicorn itself) ends the server."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: the first signal starts the drain, the next ends it."""
        if self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        if self.gate.draining:
            self._loop.call_soon_threadsafe(self.end_requests)
            return
        self._captured_signals.append(sig)
        self.gate.draining = True
        # A signal handler may interrupt the loop anywhere: schedule, don't run, the drain.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        """Refuses new requests, waits for the running ones (up to the timeout), then ends
        the rest and stops the server."""
        self.gate.draining = True
        logger.info("Shutting down: draining %d requests for up to %gs",
                    self.engine.num_unfinished_requests, self.timeout_s)
        deadline = self.clock() + self.timeout_s
        while self.engine.num_unfinished_requests and self.clock() < deadline:
            if self.should_exit:
                return
            await asyncio.sleep(0.05)
        self.end_requests()

    def end_requests(self) -> None:
        """Ends every request still in flight with an error and stops the server."""
        if self.engine.num_unfinished_requests:
            logger.info("Shutting down: ending %d requests still running",
                        self.engine.num_unfinished_requests)
        self.engine.fail_requests(SHUTDOWN_REASON)
        self.should_exit = True
