"""Dropping clients that stop reading.

A client that keeps its connection open but never reads fills the socket buffers; from then on
every body write of its response waits. Without a bound that response's task, its engine
requests and their KV blocks would be held as long as the client likes. `StalledSendGuard`
gives each write a deadline and, when one passes, ends the response the way a disconnect does
(the route's stream is cancelled, which aborts its engine requests) and lets the server close
the connection. The memory a stalled stream holds meanwhile is bounded too: the socket's
buffers, and one merged pending output per request (`RequestStream`).
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

_DISCONNECT: Message = {"type": "http.disconnect"}


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
                return  # dropped: the connection is closed once the app returns
            try:
                await asyncio.wait_for(send(message), self.timeout_s)
            except TimeoutError:
                stalled.set()
                logger.warning(
                    "dropping a client of %s that read nothing for %.0f s (stalled response)",
                    scope.get("path", "?"), self.timeout_s)
                # Not raised: that would end the response with a traceback. A stream is
                # cancelled through `guarded_receive`; any other response finishes unsent.

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
