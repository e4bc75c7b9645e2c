"""Tests for vllm/entrypoints/anthropic/streaming.py: a streamed reply's blocks add up to the
whole reply's content (serving_messages.content_blocks), however it is split, and a failing
stream ends with one `error` event."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import pytest

from vllm.entrypoints.anthropic.serving_messages import content_blocks
from vllm.entrypoints.anthropic.streaming import MessageEvents, anthropic_events
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.tools import ToolCallStream, parse_reply, plan_tools
from vllm.exceptions import EngineDeadError

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'


def _plan():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    return plan_tools(request.tools, None, None, "hermes")


def _rebuild(events: list[str]) -> list[dict]:
    """The content blocks a client builds from the events (as Anthropic's SDK does)."""
    blocks: list[dict] = []
    partial: dict[int, str] = {}
    for kind, data in re.findall(r"event: (\w+)\ndata: (.*)\n\n", "".join(events)):
        body = json.loads(data)
        if kind == "content_block_start":
            assert body["index"] == len(blocks)
            blocks.append(body["content_block"])
        elif kind == "content_block_delta":
            block, delta = blocks[body["index"]], body["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                partial[body["index"]] = partial.get(body["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop" and body["index"] in partial:
            blocks[body["index"]]["input"] = json.loads(partial[body["index"]])
    return blocks


@pytest.mark.parametrize("reply", [
    "Hi there\n\n" + CALL + "\n" + CALL + "\n",
    "  \n",
    "Plain text, trailing space  ",
    "\n\nLeading blank line",
    CALL,
    "<tool_call>\nnot a call",
])
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_streamed_blocks_add_up_to_the_whole_reply(reply: str, piece: int) -> None:
    plan = _plan()
    content, calls = parse_reply(plan, reply)
    whole = content_blocks("thought", content, calls)
    events = MessageEvents("msg_1", "m")
    stream = ToolCallStream(plan)
    out = [events.start(3), *events.thinking("tho"), *events.thinking("ught")]
    for i in range(0, len(reply), piece):
        text, deltas = stream.update(reply[i:i + piece])
        if i + piece >= len(reply) and (rest := stream.finish()) is not None:
            text = (text or "") + rest
        if text:
            out += events.text(text)
        for delta in deltas:
            out += events.tool_call(delta)
    out += events.finish("end_turn", None, 7)
    rebuilt = _rebuild(out)
    for block in whole + rebuilt:  # call ids are fresh for every reading
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    assert rebuilt == whole
    assert out[-2].startswith("event: message_delta\n") and '"output_tokens":7' in out[-2]
    assert out[-1] == 'event: message_stop\ndata: {"type":"message_stop"}\n\n'


@pytest.mark.parametrize("error,status,kind", [
    (RuntimeError("boom"), 500, "api_error"),
    (EngineDeadError("engine core died"), 503, "overloaded_error"),
])
def test_a_failing_stream_ends_with_one_error_event(error, status, kind) -> None:
    async def chunks() -> AsyncIterator[str]:
        yield "event: ping\ndata: {}\n\n"
        raise error

    async def collect() -> list[str]:
        return [chunk async for chunk in anthropic_events(chunks())]

    out = asyncio.run(collect())
    assert len(out) == 2 and out[0].startswith("event: ping")
    kind_line, data_line = out[1].rstrip("\n").split("\n")
    assert kind_line == "event: error"
    body = json.loads(data_line.removeprefix("data: "))
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert str(error) in body["error"]["message"]
