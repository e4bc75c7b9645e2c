"""Tests for vllm/entrypoints/openai/tool_parsers/: each --tool-call-parser format reads its
family's calls from whole replies and from any split of a stream, and its strict structural
tag accepts exactly the calls the schemas allow (and reads back to the same call)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.tool_parsers import FORMATS
from vllm.entrypoints.openai.tools import ToolCallStream, parse_reply, plan_tools

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
SAY = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
ARGS = {"add": {"a": 1, "b": 22}, "say": {"text": 'x}{"] <y>'}}


# Test labels for a format's second way of writing calls: the parser name it uses.
STYLES = {"mistral_args": "mistral"}


def plan(parser: str, strict: bool = True, parallel: bool = True):
    tools = [{"type": "function", "function": {"name": name, "parameters": schema,
                                                "strict": strict}}
             for name, schema in (("add", ADD), ("say", SAY))]
    r = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                              tools=tools, parallel_tool_calls=parallel)
    return plan_tools(r.tools, r.tool_choice, r.parallel_tool_calls, STYLES.get(parser, parser))


def written(parser: str, calls: list[tuple[str, dict]]) -> str:
    """The calls as the family's model writes them."""
    if parser == "hermes":
        return "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n'
                       "</tool_call>" for n, a in calls)
    if parser in ("qwen3_xml", "qwen3_coder"):
        def params(a: dict) -> str:
            return "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())
        return "".join(f"<tool_call>\n<function={n}>\n{params(a)}</function>\n</tool_call>"
                       for n, a in calls)
    if parser == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    if parser == "mistral_args":  # tokenizer v11 and later
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    assert parser == "llama3_json"
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


# (content before the calls, content after them) as each family writes a reply.
FRAMES = {"hermes": ("I will add. ", " Done <tool_ca"), "qwen3_xml": ("Sure: ", "\n"),
          "qwen3_coder": ("", ""), "mistral": ("Calling [TOOL_", ""), "mistral_args": ("Calling [TOOL_", " done"),
          "llama3_json": ("", "")}
CALLS = [("add", ARGS["add"]), ("say", ARGS["say"])]


def replay(p, text: str, cut: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """Streams `text` cut at `cut`; returns (content, [(name, arguments)])."""
    stream = ToolCallStream(p)
    content, calls = "", {}
    bounds = [0, *cut, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        piece, deltas = stream.update(text[a:b])
        content += piece or ""
        for d in deltas:
            entry = calls.setdefault(d["index"], ["", ""])
            if "id" in d:
                entry[0] = d["function"]["name"]
            entry[1] += d["function"]["arguments"]
    content += stream.finish() or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


def test_every_format_is_a_parser_choice() -> None:
    assert set(FORMATS) | set(STYLES) == set(FRAMES) == {"mistral_args","hermes", "mistral", "llama3_json", "qwen3_xml", "qwen3_coder"}


@pytest.mark.parametrize("parser", sorted(FRAMES))
def test_a_reply_reads_back_as_its_calls_and_content(parser) -> None:
    before, after = FRAMES[parser]
    calls = CALLS
    text = before + written(parser, calls) + after
    content, got = parse_reply(plan(parser), text)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert (content or "") == (before + after if (before + after).strip() else "")
    for a in range(0, len(text), 5):
        for b in range(a, len(text), 13):
            streamed_content, streamed = replay(plan(parser), text, [a, b])
            assert [(n, json.loads(args)) for n, args in streamed] == calls, (a, b)
            assert streamed_content == before + after, (a, b)


@pytest.mark.parametrize("parser", sorted(FRAMES))
def test_arguments_stream_before_the_reply_ends(parser) -> None:
    text = written(parser, CALLS)
    stream = ToolCallStream(plan(parser))
    seen_before_end = ""
    for ch in text[:-15]:
        _, deltas = stream.update(ch)
        seen_before_end += "".join(d["function"]["arguments"] for d in deltas)
    # The first call's arguments were out before the reply ended.
    assert json.loads(seen_before_end[: seen_before_end.index("}") + 1]) == ARGS["add"]


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "mistral", "llama3_json"])
def test_a_reply_without_calls_is_content(parser) -> None:
    text = "Just text, no call: {not json} <tool> [TOOL] ok"
    assert parse_reply(plan(parser), text) == (text, [])


def test_qwen3_xml_types_values_by_the_schema() -> None:
    text = ("<tool_call>\n<function=add>\n<parameter=a>\n5\n</parameter>\n<parameter=b>\n"
            "x\n</parameter>\n</function>\n</tool_call><tool_call>\n<function=say>\n"
            "<parameter=text>\n12\n</parameter>\n</function>\n</tool_call>")
    _, calls = parse_reply(plan("qwen3_xml"), text)
    # An integer parameter parses ("x" does not, and stays a string); a string stays one.
    assert [json.loads(c.arguments) for c in calls] == [{"a": 5, "b": "x"}, {"text": "12"}]


def test_llama3_json_reads_the_python_tag_and_semicolons() -> None:
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}};{"name": "say", ' \
           '"arguments": {"text": "t"}}'
    content, calls = parse_reply(plan("llama3_json"), text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("say", {"text": "t"})]


def accepts(tag: dict, text: str) -> bool:
    return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(json.dumps(tag)), text)


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "mistral", "mistral_args",
                                    "llama3_json"])
def test_the_strict_tag_admits_valid_calls_only(parser) -> None:
    p = plan(parser)
    kind, tag = p.constraint()
    assert kind == "structural_tag"
    before = "" if parser == "llama3_json" else "Let me call. "
    good = before + written(parser, [("add", {"a": 1, "b": 2})])
    assert accepts(tag, good)
    assert [json.loads(c.arguments) for c in parse_reply(p, good)[1]] == [{"a": 1, "b": 2}]
    for bad in ({"a": "one", "b": 2}, {"a": 1}):
        assert not accepts(tag, before + written(parser, [("add", bad)])), bad
    assert not accepts(tag, before + written(parser, [("nope", {"a": 1, "b": 2})]))
    assert accepts(tag, "Free text without any call.")


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "mistral_args", "llama3_json"])
def test_without_parallel_calls_the_tag_stops_after_one(parser) -> None:
    _, tag = plan(parser, parallel=False).constraint()
    one = written(parser, [("add", {"a": 1, "b": 2})])
    assert accepts(tag, one)
    separator = "; " if parser == "llama3_json" else ""
    assert not accepts(tag, one + separator + written(parser, [("say", {"text": "t"})]))


def test_mistral_without_parallel_calls_allows_one_element() -> None:
    _, tag = plan("mistral", parallel=False).constraint()
    assert accepts(tag, written("mistral", [("add", {"a": 1, "b": 2})]))
    assert not accepts(tag, written("mistral", CALLS))


def test_mistral_reads_a_call_id_and_text_between_calls() -> None:
    text = ('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1, "b": 2} and '
            '[TOOL_CALLS][{"name": "say", "arguments": {"text": "t"}}]')
    content, calls = parse_reply(plan("mistral"), text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("say", {"text": "t"})]
    assert content == " and "


def test_mistral_name_without_arguments_is_content() -> None:
    text = "see [TOOL_CALLS]add and nothing else"
    assert parse_reply(plan("mistral"), text) == (text, [])
