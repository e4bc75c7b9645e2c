"""Tests for vllm/entrypoints/openai/responses_events.py: a streamed reply's text and tool
calls become OpenAI's Responses events, with a function call's arguments streamed as the
model writes them, and the items add up to what the whole reply parses into."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.test_tools import plan
from vllm.entrypoints.openai.responses_events import ResponseEvents
from vllm.entrypoints.openai.tools import ToolCallStream, parse_reply

REPLY = ('\n\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 3}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>')


def _events(chunks: list[str], mode: dict) -> list[dict]:
    """The events of a reply streamed in `chunks` through ToolCallStream, decoded."""
    tool_plan = plan(**mode)
    stream, events = ToolCallStream(tool_plan), ResponseEvents()
    raw: list[str] = []
    for i, chunk in enumerate(chunks):
        content, calls = stream.update(chunk)
        if i == len(chunks) - 1 and (rest := stream.finish()) is not None:
            content = (content or "") + rest
        raw += events.answer(content or "") + events.tool_calls(calls)
    raw += events.finish()
    decoded = []
    for event in raw:
        kind, data = event.split("\n", 1)
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        decoded.append(body)
    assert [e["sequence_number"] for e in decoded] == list(range(len(decoded)))
    return decoded


def _split_every(text: str, n: int) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


@pytest.mark.parametrize("size", [1, 3, 7, len(REPLY)])
def test_calls_stream_their_arguments_and_add_up_to_the_whole_reply(size: int) -> None:
    events = _events(_split_every(REPLY, size), {})
    _, want = parse_reply(plan(), REPLY)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    # The whitespace before the calls is no message item, as in the whole response.
    assert [(i["type"], i["name"], i["arguments"]) for i in done] == [
        ("function_call", c.name, c.arguments) for c in want]
    for index, item in enumerate(done):
        mine = [e for e in events if e.get("output_index") == index]
        kinds = [e["type"] for e in mine]
        assert kinds[0] == "response.output_item.added"
        assert mine[0]["item"]["status"] == "in_progress" and mine[0]["item"]["arguments"] == ""
        assert mine[0]["item"]["call_id"] == item["call_id"]
        assert mine[0]["item"]["id"] == item["id"]
        assert kinds[-2:] == ["response.function_call_arguments.done",
                              "response.output_item.done"]
        deltas = kinds[1:-2]
        assert deltas and set(deltas) == {"response.function_call_arguments.delta"}
        assert "".join(e["delta"] for e in mine[1:-2]) == item["arguments"]
        assert mine[-2]["arguments"] == item["arguments"]
        if size == 1:
            # Streamed as written: a delta per character of the arguments, at most.
            assert len(deltas) >= len(json.dumps(json.loads(item["arguments"]))) // 2


def test_text_then_a_named_call() -> None:
    """tool_choice naming a function: the whole answer is its arguments, streamed."""
    chunks = ['{"city"', ': "Pa', 'ris"}']
    events = _events(chunks, {"tool_choice": {"type": "function",
                                              "function": {"name": "get_weather"}}})
    assert [e["delta"] for e in events
            if e["type"] == "response.function_call_arguments.delta"] == chunks
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["name"], i["arguments"]) for i in done] == [
        ("function_call", "get_weather", '{"city": "Paris"}')]


def test_answer_text_before_a_call_is_a_message_and_lone_whitespace_is_kept() -> None:
    events = _events(["Sure.", REPLY[:40], REPLY[40:]], {})
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["message", "function_call", "function_call"]
    # The text of the whole reply's message, but for the whitespace beside the calls.
    content, _ = parse_reply(plan(), "Sure." + REPLY)
    assert done[0]["content"][0]["text"] == content.strip() == "Sure."
    # Only whitespace and no call: it is the reply's message.
    events = _events([" ", "\n"], {})
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["content"][0]["text"]) for i in done] == [("message", " \n")]
