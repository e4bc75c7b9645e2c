"""Tests for vllm/entrypoints/openai/tools.py: tool plans, their constraints, and reading
tool calls back from whole replies and from any split of a streamed one."""

from __future__ import annotations

import json

import jsonschema
import pytest

from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.tools import (
    ToolCallStream,
    parse_reply,
    plan_tools,
)
from vllm.exceptions import InvalidRequestError

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}},
           "required": ["city"]}


def request(tools: list[dict] | None = None, **kwargs) -> ChatCompletionRequest:
    if tools is None:
        tools = [
            {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}},
            {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
        ]
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools,
                                 **kwargs)


def plan(parser: str | None = "hermes", **kwargs):
    r = request(**kwargs)
    return plan_tools(r.tools, r.tool_choice, r.parallel_tool_calls, parser)


def test_modes_and_their_constraints() -> None:
    assert plan(tools=[]) is None
    assert plan(tool_choice="none").constraint() is None
    named = plan(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and named.constraint() == ("json", WEATHER)
    auto = plan()  # tool_choice defaults to auto when tools are given
    key, tag = auto.constraint()
    fmt = tag["format"]
    assert key == "structural_tag" and fmt["triggers"] == ["<tool_call>"]
    assert [t["content"]["json_schema"] for t in fmt["tags"]] == [ADD, {"type": "object"}]
    assert fmt["tags"][0]["begin"] == '<tool_call>\n{"name": "add", "arguments": '
    assert not fmt["stop_after_first"]
    assert plan(parallel_tool_calls=False).constraint()[1]["format"]["stop_after_first"]
    non_strict = plan(tools=[{"type": "function", "function": {"name": "f"}}])
    assert non_strict.constraint() is None


@pytest.mark.parametrize("parallel", [None, False])
def test_required_schema_accepts_exactly_calls_of_the_tools(parallel) -> None:
    key, schema = plan(tool_choice="required", parallel_tool_calls=parallel).constraint()
    assert key == "json"
    good = [{"name": "add", "arguments": {"a": 1, "b": 2}},
            {"name": "get_weather", "arguments": {"city": "Lima"}}]
    bad = [
        [],
        [{"name": "add", "arguments": {"a": 1}}],
        [{"name": "sub", "arguments": {"a": 1, "b": 2}}],
        [{"name": "get_weather", "arguments": {"city": "Rome"}}],
    ]
    if parallel is False:
        bad.append(good)
        good = good[:1]
    jsonschema.validate(good, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)


# What pydantic writes for nested models: definitions under $defs, referenced from the root.
ORDER = {
    "$defs": {
        "Item": {"type": "object", "properties": {"sku": {"type": "string"},
                                                   "qty": {"type": "integer", "minimum": 1}},
                 "required": ["sku", "qty"], "additionalProperties": False},
    },
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1}},
    "required": ["items"],
    "additionalProperties": False,
}
# Another tool with a definition of the same name: the two must not collide.
REFUND = {
    "definitions": {"Item": {"type": "object", "properties": {"id": {"type": "integer"}},
                             "required": ["id"], "additionalProperties": False}},
    "type": "object",
    "properties": {"item": {"$ref": "#/definitions/Item"}},
    "required": ["item"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_tools_with_definitions_keep_their_references(tool_choice) -> None:
    """Nested models' definitions must still resolve once the tools' schemas are combined
    (a `$ref` into `$defs` was a 400: "Cannot find field '$defs'")."""
    tools = [{"type": "function", "function": {"name": "order", "parameters": ORDER}},
             {"type": "function", "function": {"name": "refund", "parameters": REFUND}}]
    choice = (tool_choice if tool_choice == "required"
              else {"type": "function", "function": {"name": "order"}})
    key, schema = plan(tools=tools, tool_choice=choice).constraint()
    order = {"items": [{"sku": "a", "qty": 2}]}
    if tool_choice == "required":
        good = [{"name": "order", "arguments": order}, {"name": "refund", "arguments": {"item": {"id": 3}}}]
        bad = [[{"name": "order", "arguments": {"items": [{"sku": "a", "qty": 0}]}}],
               [{"name": "refund", "arguments": {"item": {"sku": "a", "qty": 2}}}]]
    else:
        good, bad = order, [{"items": [{"sku": "a"}]}]
    jsonschema.validate(good, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    import xgrammar as xgr

    xgr.Grammar.from_json_schema(json.dumps(schema))  # compiles: every reference resolves


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
                    {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
                    {"type": "string"}}}]}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {"name": "f"}}]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_bad_tools_name_the_field(kwargs, param) -> None:
    with pytest.raises(InvalidRequestError) as e:
        plan(**kwargs)
    assert e.value.param == param


def test_auto_needs_a_tool_call_parser() -> None:
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice"):
        plan(parser=None)
    assert plan(parser=None, tool_choice="required").mode == "required"


def test_parse_hermes() -> None:
    text = ('Let me see.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call>\n<tool_call>{"bad json</tool_call> tail <tool_call>{"name": "f"')
    content, calls = parse_reply(plan(), text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert content == ('Let me see.\n\n<tool_call>{"bad json</tool_call> tail '
                       '<tool_call>{"name": "f"')
    content, calls = parse_reply(plan(), '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", "{}")]


def test_parse_reply_by_mode() -> None:
    named = plan(tool_choice={"type": "function", "function": {"name": "add"}})
    assert [(c.name, c.arguments) for c in parse_reply(named, '{"a": 1}')[1]] == [
        ("add", '{"a": 1}')]
    required = plan(tool_choice="required")
    content, calls = parse_reply(required, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    assert content is None and calls[0].name == "add"
    assert parse_reply(required, '[{"name": "add", "argu') == ('[{"name": "add", "argu', [])
    assert parse_reply(plan(tool_choice="none"), "hi") == ("hi", [])
    assert parse_reply(named, None) == (None, [])


def _replay(p, text: str, cut: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """Streams `text` cut at the positions `cut`; returns (content, [(name, arguments)])."""
    stream = ToolCallStream(p)
    content = ""
    calls: dict[int, list[str]] = {}
    bounds = [0, *cut, len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        piece, deltas = stream.update(text[a:b])
        content += piece or ""
        if i == len(bounds) - 2:
            content += stream.finish() or ""
        for d in deltas:
            entry = calls.setdefault(d["index"], ["", ""])
            if "id" in d:
                assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function"
                entry[0] = d["function"]["name"]
            entry[1] += d["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


ARGS_WITH_BRACES = '{"s": "}{\\"]", "n": [1, {"m": 2}]}'
CASES = {
    "auto": (
        {},
        'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        f' and <tool_call>{{"name": "get_weather", "arguments": {ARGS_WITH_BRACES}}}'
        '</tool_call> <tool_ca',
        [("add", {"a": 1, "b": 2}), ("get_weather", json.loads(ARGS_WITH_BRACES))],
        "Hi  and  <tool_ca",
    ),
    "auto_whole": (  # arguments before the name: read whole when the block closes
        {},
        '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>'
        '<tool_call>{"name": "add", "arguments": 5}</tool_call>'
        "<tool_call>not json</tool_call>",
        [("add", {"a": 1})],
        '<tool_call>{"name": "add", "arguments": 5}</tool_call><tool_call>not json</tool_call>',
    ),
    "required": (
        {"tool_choice": "required"},
        f'[{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}, \n'
        f'{{"name": "get_weather", "arguments": {ARGS_WITH_BRACES}}}]',
        [("add", {"a": 1, "b": 2}), ("get_weather", json.loads(ARGS_WITH_BRACES))],
        "",
    ),
    "named": (
        {"tool_choice": {"type": "function", "function": {"name": "add"}}},
        '{"a": 1, "b": 2}',
        [("add", {"a": 1, "b": 2})],
        "",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_any_split_of_a_stream_gives_the_calls_of_the_whole_reply(case) -> None:
    kwargs, text, want, want_content = CASES[case]
    p = plan(**kwargs)
    content, calls = parse_reply(p, text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    assert (content or "") == want_content
    for a in range(0, len(text), 3):
        for b in range(a, len(text), 11):
            got_content, got = _replay(p, text, [a, b])
            assert [(n, json.loads(args)) for n, args in got] == want, (a, b)
            assert got_content == want_content, (a, b)


@pytest.mark.parametrize("case", ["auto", "required", "named"])
def test_arguments_stream_as_they_are_written(case) -> None:
    kwargs, text, want, _ = CASES[case]
    stream = ToolCallStream(plan(**kwargs))
    argument_deltas = 0
    for ch in text:
        _, deltas = stream.update(ch)
        argument_deltas += sum(1 for d in deltas if "id" not in d)
    # Every call's arguments came in pieces, not in one delta at the end.
    assert argument_deltas > 10 * len(want)


def test_named_call_is_announced_with_its_first_text() -> None:
    stream = ToolCallStream(plan(tool_choice={"type": "function", "function": {"name": "add"}}))
    assert stream.update("") == (None, [])  # nothing of the answer yet (still thinking)
    _, deltas = stream.update("{")
    assert deltas[0]["function"] == {"name": "add", "arguments": "{"} and "id" in deltas[0]


def test_a_call_cut_off_keeps_its_partial_arguments() -> None:
    content, calls = parse_reply(plan(), 'x<tool_call>{"name": "add", "arguments": {"a": 1')
    assert content == "x" and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1')]
    content, calls = parse_reply(plan(), 'x<tool_call>{"name": "ad')
    assert content == 'x<tool_call>{"name": "ad' and calls == []


def test_a_chat_request_plans_its_tools_once(monkeypatch) -> None:
    """The plan (which checks every tool's schema) is made once per request, not again for
    the response or the stream."""
    from vllm.entrypoints.openai import serving_chat

    calls = []

    def counting(*args):
        calls.append(args)
        return plan_tools(*args)

    monkeypatch.setattr(serving_chat, "plan_tools", counting)
    chat = serving_chat.OpenAIServingChat.__new__(serving_chat.OpenAIServingChat)
    chat.tool_call_parser, chat.tool_call_strict = "hermes", "off"
    r = request()
    first = chat.tool_plan(r)
    assert chat.tool_plan(r) is first and len(calls) == 1
    assert chat.tool_plan(request()) is not first and len(calls) == 2


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json", "qwen3_xml"])
@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_strict_policy_makes_every_function_strict(parser, choice) -> None:
    """--tool-call-strict: `off` is the client's plan unchanged; `function` is the plan the
    client would get by marking every function strict; `parameter` that plan with closed
    objects."""
    tool_choice = (choice if choice != "named"
                   else {"type": "function", "function": {"name": "get_weather"}})
    loose = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
             {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    strict = [{"type": "function", "function": {**t["function"], "strict": True}}
              for t in loose]

    def plan_of(tools, policy=None):
        r = request(tools, tool_choice=tool_choice)
        args = (r.tools, r.tool_choice, r.parallel_tool_calls, parser)
        return plan_tools(*args) if policy is None else plan_tools(*args, policy)

    assert plan_of(loose, "off") == plan_of(loose)
    by_policy = plan_of(loose, "function")
    assert by_policy == plan_of(strict) and not by_policy.closed
    assert by_policy.constraint() is not None
    closed = plan_of(loose, "parameter")
    assert closed.closed and closed.constraint() == by_policy.constraint()
    if choice == "auto":
        assert plan_of(loose).constraint() is None  # no strict function, no constraint
