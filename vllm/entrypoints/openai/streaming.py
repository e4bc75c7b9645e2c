"""Server-sent events and the request lifecycle around them: the SSE framing, the event
stream that ends with an error event instead of a broken connection, merging a request's
`n` streams, and cancelling a request whose client went away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from vllm.entrypoints.openai.errors import ClientDisconnected, exception_error
from vllm.exceptions import EngineDeadError
from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import RequestStream

logger = logging.getLogger(__name__)

T = TypeVar("T")


def sse(data: str) -> str:
    """One server-sent event carrying `data`."""
    return f"data: {data}\n\n"


async def sse_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """`chunks`, then `[DONE]`; an engine death while streaming becomes a 503 error event,
    and any other failure an error event of its kind (logged with its traceback), so the
    client always reads one clean error line and the end of the stream."""
    # Closing this stream (client gone) must close `chunks` at once, so that it aborts
    # its engine requests now rather than when garbage collected.
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        except EngineDeadError as e:
            yield exception_error(e).event()
        except Exception as e:
            # The response already answered 200: an error event is all that can still tell
            # the client, and without it the stream would just break off.
            logger.exception("a streaming response failed")
            yield exception_error(e).event()
    yield "data: [DONE]\n\n"


async def cancel_on_disconnect(awaitable: Awaitable[T], raw_request: Request) -> T:
    """Awaits `awaitable`, cancelling it if the HTTP client disconnects first.

    Raises ClientDisconnected in that case (cancellation aborts the engine requests).
    """
    task = asyncio.ensure_future(awaitable)

    async def wait_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (stream index, output) from several streams as outputs arrive.

    Errors of any stream are raised here; leaving early aborts every stream.
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()
