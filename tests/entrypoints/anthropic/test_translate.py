"""Tests for vllm/entrypoints/anthropic/translate.py: Messages requests as chat requests,
chat field names as Anthropic's, stop reasons, and tool inputs from (cut-off) arguments."""

from __future__ import annotations

import json

import pytest

from vllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from vllm.entrypoints.anthropic.translate import (
    anthropic_param,
    stop_reason,
    to_chat_request,
    tool_input,
)
from vllm.exceptions import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}


def chat(**fields):
    fields.setdefault("model", "m")
    fields.setdefault("max_tokens", 8)
    return to_chat_request(MessagesRequest.model_validate(fields))


def messages(request) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in request.messages]


def test_a_conversation_with_tools_becomes_chat_messages_in_order() -> None:
    request = chat(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Find "},
                                         {"type": "text", "text": "cats"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Searching."},
                {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"q": "cats"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 cats"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "Thanks"},
            ]},
        ],
        tools=[{"name": "search", "description": "Web search", "input_schema": SCHEMA,
                "cache_control": {"type": "ephemeral"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_k=3, max_tokens=9,
    )
    assert messages(request) == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Find \ncats"},
        {"role": "assistant", "content": "Searching.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "search", "arguments": json.dumps({"q": "cats"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3 cats"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": "Thanks"},
    ]
    assert [t.model_dump(exclude_none=True) for t in request.tools] == [
        {"type": "function", "function": {"name": "search", "description": "Web search",
                                          "parameters": SCHEMA}}]
    assert (request.tool_choice, request.parallel_tool_calls) == ("required", False)
    assert (request.stop, request.temperature, request.top_k) == (["END"], 0.5, 3)
    assert request.max_completion_tokens == 9
    assert request.request_id.startswith("msg_")
    assert not request.continue_final_message and request.add_generation_prompt


def test_choices_prefill_and_thinking_switch() -> None:
    tools = [{"name": "f", "input_schema": SCHEMA}]
    named = chat(messages=[{"role": "user", "content": "x"}], tools=tools,
                 tool_choice={"type": "tool", "name": "f"})
    assert named.tool_choice.function.name == "f" and named.parallel_tool_calls is None
    for kind, expected in (("auto", "auto"), ("none", "none")):
        got = chat(messages=[{"role": "user", "content": "x"}], tools=tools,
                   tool_choice={"type": kind})
        assert got.tool_choice == expected
    prefilled = chat(messages=[{"role": "user", "content": "x"},
                               {"role": "assistant", "content": "The answer is"}])
    assert prefilled.continue_final_message and not prefilled.add_generation_prompt
    off = chat(messages=[{"role": "user", "content": "x"}], thinking={"type": "disabled"})
    assert off.chat_template_kwargs == {"enable_thinking": False}
    assert off.thinking_token_budget is None
    on = chat(messages=[{"role": "user", "content": "x"}],
              thinking={"type": "enabled", "budget_tokens": 1024})
    assert on.chat_template_kwargs == {"enable_thinking": True}
    assert on.thinking_token_budget == 1024
    counted = to_chat_request(CountTokensRequest(model="m",
                                                 messages=[{"role": "user", "content": "x"}]))
    assert counted.max_completion_tokens is None and not counted.stream


def test_image_blocks_become_image_url_parts_named_by_their_block() -> None:
    """A user turn with images becomes parts in block order (text blocks still joined by
    newlines, a base64 source a data URL, a url source as sent); a text-only turn stays a
    string. Each part's chat name maps back to its block, after a tool_result split the
    turn and behind a system message."""
    request = chat(system="Look closely.", messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "done"},
            {"type": "text", "text": "Compare"},
            {"type": "text", "text": "these:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0K"}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/b.jpg"},
             "cache_control": {"type": "ephemeral"}},
        ]},
    ])
    got = messages(request)
    assert got[1] == {"role": "user", "content": "Hi"}
    assert got[3]["role"] == "tool"
    assert got[4] == {"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "text", "text": "\nthese:"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg"}}]}
    places = request._places
    assert anthropic_param("messages[4].content[2]", places) == "messages[2].content[3]"
    assert anthropic_param("messages[4].content[3].image_url", places) == \
        "messages[2].content[4].image_url"
    assert anthropic_param("messages[1].content", places) == "messages"
    assert anthropic_param("messages[4].content[2]") == "messages"


@pytest.mark.parametrize("fields,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/svg+xml", "data": "AA=="}}]}]},
     "messages[0].content[0].source.media_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png"}}]}]},
     "messages[0].content[0].source.data"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "file", "file_id": "file_1"}}]}]},
     "messages[0].content[0].source.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/a.png"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]},
     "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]},
     "messages[0].content[0].input"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": SCHEMA, "color": "red"}]}, "tools[0].color"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "auto", "name": "f"}}, "tool_choice.name"),
    ({"thinking": {"type": "disabled", "budget_tokens": 5}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
])
def test_what_cannot_be_served_is_refused_by_name(fields, param) -> None:
    fields.setdefault("messages", [{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequestError) as refused:
        chat(**fields)
    assert refused.value.param == param


def test_chat_field_names_become_anthropic_names() -> None:
    assert anthropic_param("max_completion_tokens") == "max_tokens"
    assert anthropic_param("max_tokens") == "max_tokens"
    assert anthropic_param("stop") == "stop_sequences"
    assert anthropic_param("messages[3].content") == "messages"
    assert anthropic_param("tools[1].function.parameters") == "tools[1].input_schema"
    assert anthropic_param("tools[0].function.name") == "tools[0].name"
    assert anthropic_param("tool_choice.function.name") == "tool_choice.name"
    assert anthropic_param("structured_outputs.json") == "tools"
    assert anthropic_param("thinking_token_budget") == "thinking.budget_tokens"
    assert anthropic_param("temperature") == "temperature"
    assert anthropic_param(None) is None


def test_stop_reasons() -> None:
    assert stop_reason(None, None, False) == (None, None)
    assert stop_reason("length", None, True) == ("max_tokens", None)
    assert stop_reason("stop", None, True) == ("tool_use", None)
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, False) == ("end_turn", None)
    assert stop_reason("stop", None, False) == ("end_turn", None)


@pytest.mark.parametrize("arguments,expected", [
    ('{"a": 1, "b": [1, 2]}', {"a": 1, "b": [1, 2]}),
    ('{"a": 1, "b": [1, 2', {"a": 1, "b": [1]}),
    ('{"a": 1, "b": "x,y', {"a": 1}),
    ('{"a": {"c": "}"}, "b', {"a": {"c": "}"}}),
    ('{"a": "\\"", "b": 2', {"a": "\""}),
    ('{"a": 1', {}),
    ('', {}),
    ('[1, 2]', {}),
])
def test_tool_input_keeps_the_whole_members_of_cut_off_arguments(arguments, expected) -> None:
    assert tool_input(arguments) == expected
