"""A streaming response that fails after its 200 still ends with one clean error event and
`[DONE]`, whatever the failure was (the traceback goes to the log)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from vllm.entrypoints.openai.streaming import sse_events
from vllm.exceptions import EngineDeadError

UGLY = ("\x1b[31mboom\x1b[0m\nTraceback (most recent call last):\n"
        "  File \"x.py\", line 1\nKeyError: 'k'")


async def _failing(error: BaseException) -> AsyncIterator[str]:
    yield "data: {\"first\": 1}\n\n"
    raise error


def _events(error: BaseException) -> list[str]:
    async def collect() -> list[str]:
        return [event async for event in sse_events(_failing(error))]

    return asyncio.run(collect())


@pytest.mark.parametrize("error,status", [
    (EngineDeadError(UGLY), 503),
    (RuntimeError(UGLY), 500),
    (ValueError(UGLY), 400),
])
def test_a_failed_stream_ends_with_one_clean_error_event(error: BaseException,
                                                         status: int) -> None:
    events = _events(error)
    assert events[0] == "data: {\"first\": 1}\n\n" and events[-1] == "data: [DONE]\n\n"
    assert len(events) == 3
    raw = events[1]
    for marker in ("Traceback", "\x1b[", "\\u001b", "\\n"):
        assert marker not in raw, raw
    body = json.loads(raw[len("data: "):])
    assert body["error"]["code"] == status
    assert "boom" in body["error"]["message"] and "KeyError: 'k'" in body["error"]["message"]
