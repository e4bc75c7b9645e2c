"""POST /v1/messages and /v1/messages/count_tokens against one real server, through the
official `anthropic` client: demo-think (a scripted model that thinks `OK, the user wants an
answer.`, then writes a blank line, `<tool_call>` and tokens at random) with
`--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes` and an API
key. Greedy requests pass temperature 0 in the body (newer clients take no temperature
argument)."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest

from vllm.model_executor.model_loader.demo_scripted import SCRIPT

MODEL = "demo-think"
API_KEY = "sk-anthropic"
THOUGHT = "".join(SCRIPT[SCRIPT.index("<think>") + 1:SCRIPT.index("</think>")])
GREEDY = {"temperature": 0}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The forecast of a city.",
          "input_schema": WEATHER}]
FORCED = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(MODEL, "--max-model-len", "1024", "--reasoning-parser", "qwen3",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        api_key=API_KEY)


def client(server, **kwargs) -> anthropic.Anthropic:
    """The official client (x-api-key), no retries so that errors show at once."""
    kwargs.setdefault("api_key", API_KEY)
    return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=120, **kwargs)


def create(server, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return client(server).messages.create(model=MODEL, extra_body=GREEDY, **kwargs)


def tokenize_count(server, messages: list[dict], tools: list[dict] | None = None) -> int:
    """The server's /tokenize count of chat messages rendered by the chat template."""
    body = {"model": MODEL, "messages": messages}
    if tools is not None:
        body["tools"] = tools
    reply = httpx.post(server.url("/tokenize"), json=body, headers=server.headers(), timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def blocks(message) -> list[dict]:
    return [block.model_dump(exclude_none=True) for block in message.content]


def test_text_with_a_system_prompt_and_its_token_counts(server) -> None:
    as_string = create(server, max_tokens=16, system="Be brief.")
    as_blocks = create(server, max_tokens=16, system=[{"type": "text", "text": "Be brief."}])
    assert as_string.type == "message" and as_string.role == "assistant"
    assert as_string.id.startswith("msg_") and as_string.model == MODEL
    assert blocks(as_string) == blocks(as_blocks)
    thinking, text = as_string.content
    assert (thinking.type, thinking.thinking) == ("thinking", THOUGHT)
    assert text.type == "text" and text.text.startswith("\n\n<tool_call>")
    assert as_string.stop_reason == "max_tokens" and as_string.stop_sequence is None
    assert as_string.usage.output_tokens == 16
    counted = client(server).messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert counted.input_tokens == tokenize_count(server, chat) == as_string.usage.input_tokens
    # Without the system prompt the prompt is shorter: the system text was rendered.
    bare = create(server, max_tokens=1)
    assert bare.usage.input_tokens == tokenize_count(server, chat[1:]) < counted.input_tokens


def test_a_stop_sequence_ends_the_reply(server) -> None:
    reply = create(server, max_tokens=100, stop_sequences=["zebra", "wants"])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "wants"
    assert blocks(reply) == [{"type": "thinking", "signature": "",
                              "thinking": THOUGHT[:THOUGHT.index("wants")]}]


def test_a_forced_tool_gives_a_tool_use_block_that_validates(server) -> None:
    reply = create(server, max_tokens=200, tools=TOOLS, tool_choice=FORCED)
    assert reply.stop_reason == "tool_use"
    thinking, call = reply.content
    assert thinking.thinking == THOUGHT
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    # The call and its result go back as the next turn; the prompt is the chat template's
    # rendering of the same conversation in the chat format.
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id,
                                           "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "Sunny"}]},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]
    counted = client(server).messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    chat = [
        history[0],
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    functions = [{"type": "function", "function": {
        "name": "get_weather", "description": "The forecast of a city.", "parameters": WEATHER}}]
    assert counted.input_tokens == tokenize_count(server, chat, functions)
    follow_up = create(server, max_tokens=4, messages=history, tools=TOOLS, tool_choice=FORCED)
    assert follow_up.usage.input_tokens == counted.input_tokens


def test_a_thinking_budget_ends_the_thought_and_the_call_still_validates(server) -> None:
    reply = create(server, max_tokens=200, tools=TOOLS, tool_choice=FORCED,
                   thinking={"type": "enabled", "budget_tokens": 3})
    thinking, call = reply.content
    thought = SCRIPT[SCRIPT.index("<think>") + 1:SCRIPT.index("</think>")]
    assert thinking.thinking == "".join(thought[:3]) != THOUGHT
    assert reply.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER)


@pytest.mark.parametrize("tools", [{}, {"tools": TOOLS, "tool_choice": FORCED}],
                         ids=["text", "tool_use"])
def test_the_stream_rebuilds_the_message(server, tools) -> None:
    kwargs = dict(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Hi"}],
                  extra_body=GREEDY, **tools)
    whole = client(server).messages.create(**kwargs)
    with client(server).messages.stream(**kwargs) as stream:
        rebuilt = stream.get_final_message()
    assert rebuilt.id.startswith("msg_") and rebuilt.id != whole.id
    assert without_ids(rebuilt) == without_ids(whole)
    assert whole.content[-1].type == ("tool_use" if tools else "text")


def without_ids(message) -> dict:
    """The message without its id and its tool calls' ids (fresh for every reply)."""
    body = message.model_dump(exclude={"id"})
    for block in body["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    return body


def test_stream_events_come_in_anthropics_order(server) -> None:
    body = {"model": MODEL, "max_tokens": 100, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
            "tool_choice": FORCED}
    with httpx.stream("POST", server.url("/v1/messages"), json=body, timeout=60,
                      headers={"x-api-key": API_KEY}) as reply:
        assert reply.status_code == 200
        text = reply.read().decode()
    events = re.findall(r"event: (\w+)\ndata: (.*)\n\n", text)
    assert "".join(f"event: {k}\ndata: {d}\n\n" for k, d in events) == text
    assert all(json.loads(data)["type"] == kind for kind, data in events)
    kinds = " ".join(kind for kind, _ in events)
    block = r"content_block_start( content_block_delta)+ content_block_stop"
    assert re.fullmatch(rf"message_start( {block}){{2}} message_delta message_stop", kinds), kinds
    deltas = [json.loads(d)["delta"]["type"] for k, d in events if k == "content_block_delta"]
    assert set(deltas) == {"thinking_delta", "input_json_delta"}


def test_x_api_key_and_bearer_are_accepted_and_a_wrong_key_is_refused(server) -> None:
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client(server, api_key="sk-wrong").messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"
    bearer = client(server, api_key=None, auth_token=API_KEY).messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert bearer.input_tokens > 0


@pytest.mark.parametrize("body,status,kind,names", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"model": "no-such-model", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
     404, "not_found_error", "no-such-model"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
    ]}]}, 400, "invalid_request_error", "messages[0].content[1]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
      "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"}},
     400, "invalid_request_error", "tool_choice.name"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
      "thinking": {"type": "enabled", "budget_tokens": -1}},
     400, "invalid_request_error", "thinking.budget_tokens"),
], ids=["no-max-tokens", "unknown-model", "image", "unknown-tool", "negative-budget"])
def test_errors_in_anthropics_shape(server, body, status, kind, names) -> None:
    body = {"model": MODEL, **body}
    reply = httpx.post(server.url("/v1/messages"), json=body, timeout=60,
                       headers={"x-api-key": API_KEY})
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert names in error["error"]["message"]
