"""Dropping clients that stop reading.

A client that keeps its connection open but never reads fills the socket buffers; from then on
every body write of its response waits. Without a bound that response's task, its engine
requests and their KV blocks would be held as long as the client likes. `StalledSendGuard`
gives each write a deadline and, when one passes, ends the response the way a disconnect does
(the route's stream is cancelled, which aborts its engine requests) and drops the connection.
The memory a stalled stream holds meanwhile is bounded too: the socket's buffers, and one
merged pending output per request (`RequestStream`).

Dropping the connection needs the server's help: ASGI has no message that ends a response
whose last write cannot go out, and uvicorn logs an ERROR for a response that was left
unfinished ("ASGI callable returned without completing response."), as for a crash.
`AbortableHTTPProtocol` (uvicorn's HTTP protocol, as `vllm serve` runs it) puts the
connection's abort in each request's scope; the guard calls it, uvicorn sees a client gone,
and the drop is logged once, as our warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger(__name__)

_DISCONNECT: Message = {"type": "http.disconnect"}

# The scope extension holding a callable that drops the request's connection at once.
ABORT_EXTENSION = "vllm.abort_connection"


class AbortableHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools when installed, else h11), whose requests carry
    `scope["extensions"][ABORT_EXTENSION]`: a callable that aborts the connection.

    An abort, unlike the close uvicorn makes of an unfinished response, discards the
    unsent bytes instead of waiting for a client that does not read to take them, and
    uvicorn then counts the client as gone rather than the app as faulty.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Sets up the connection as uvicorn does, then has every request's scope carry
        this connection's abort."""
        super().connection_made(transport)
        app = self.app

        async def with_abort(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                scope.setdefault("extensions", {})[ABORT_EXTENSION] = transport.abort
            await app(scope, receive, send)

        self.app = with_abort


class StalledSendGuard:
    """ASGI middleware: an HTTP write that cannot complete within `timeout_s` seconds ends its
    response as if the client had disconnected, and is logged as one warning line."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Runs the app with guarded `send` and `receive` (HTTP only)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stalled = asyncio.Event()

        async def guarded_send(message: Message) -> None:
            if stalled.is_set():
                # Dropped: nothing more goes out. Yielding lets the disconnect reach the app
                # (`guarded_receive`) even when its stream never waits on anything else.
                await asyncio.sleep(0)
                return
            try:
                await asyncio.wait_for(send(message), self.timeout_s)
            except TimeoutError:
                stalled.set()
                logger.warning(
                    "dropping a client of %s that read nothing for %g s (stalled response)",
                    scope.get("path", "?"), self.timeout_s)
                # Not raised: that would end the response with a traceback. A stream is
                # cancelled through `guarded_receive`; any other response finishes unsent.
                abort: Callable[[], None] | None = (
                    scope.get("extensions") or {}).get(ABORT_EXTENSION)
                if abort is not None:
                    abort()

        async def guarded_receive() -> Message:
            if stalled.is_set():
                return _DISCONNECT
            incoming = asyncio.ensure_future(receive())
            stall = asyncio.ensure_future(stalled.wait())
            try:
                await asyncio.wait({incoming, stall}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                # Also when this wait is cancelled (the stream ended and its disconnect
                # listener with it): no task of ours may outlive the request.
                stall.cancel()
                if not incoming.done():
                    incoming.cancel()
            if incoming.done() and not incoming.cancelled():
                return incoming.result()
            return _DISCONNECT

        await self.app(scope, guarded_receive, guarded_send)
        if stalled.is_set():
            # The abort reports the connection lost on the loop's next turn; let it, so the
            # server sees the client gone before it checks how the response ended.
            await asyncio.sleep(0)
