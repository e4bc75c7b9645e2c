"""Structural tags written as llguidance Lark (pure Python: the text of the grammar; the
guidance backend's behaviour with it is in test_backends.py)."""

from __future__ import annotations

import json

import pytest

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.v1.structured_output.backends.structural_tag_lark import LarkWriter, parse_structural_tag


def _writer(added: dict[str, int] | None = None) -> LarkWriter:
    return LarkWriter(lambda s: "%json " + json.dumps(s), lambda r: f"/{r}/", added or {})


def test_legacy_tags_become_triggered_tags() -> None:
    legacy = {"structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
              "triggers": ["<f"]}
    fmt = parse_structural_tag(json.dumps(legacy))
    assert fmt == {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"type": "tag", "begin": "<f>", "end": "</f>",
         "content": {"type": "json_schema", "json_schema": {"type": "integer"}}}]}
    grammar = _writer().grammar(fmt)
    assert '[lazy]: TEXT "<f"' in grammar and '(">" %json {"type": "integer"} "</f>")' in grammar
    assert grammar.startswith("start: tag_2* TEXT\n")


def test_added_tokens_match_as_token_or_text() -> None:
    writer = _writer({"<tool_call>": 7, "</tool_call>": 8, "<t>": 9})
    assert writer.literal("a</tool_call>b") == '"a" (<[8]> | "</tool_call>") "b"'
    # The longest added token wins where one holds another.
    assert writer.literal("<tool_call><t>") == '(<[7]> | "<tool_call>") (<[9]> | "<t>")'
    assert writer.literal('say "x"') == '"say \\"x\\""'
    fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
        {"type": "tag", "begin": "<tool_call>{", "content": {"type": "const_string",
                                                            "value": "x"}, "end": "}"}],
           "at_least_one": True}
    grammar = writer.grammar(fmt)
    assert "TEXT <[7]>" in grammar and grammar.startswith("start: tag_2+ TEXT\n")


@pytest.mark.parametrize("fmt,fragment", [
    ({"type": "any_text"}, "'any_text'"),
    ({"type": "tags_with_separator", "tags": [], "separator": ","}, "'tags_with_separator'"),
    ({"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}, "'qwen_xml'"),
])
def test_unsupported_formats_are_named(fmt: dict, fragment: str) -> None:
    with pytest.raises(UnsupportedConstraintError) as info:
        _writer().grammar(fmt)
    assert info.value.param == "structured_outputs.structural_tag"
    assert fragment in info.value.message and "llguidance" in info.value.message


@pytest.mark.parametrize("value,fragment", [
    ("{not json", "not valid JSON"),
    ([1], "must be a JSON object"),
    ({"structures": [{"begin": "<f>"}], "triggers": ["<f"]}, "legacy tags"),
    ({"type": "structural_tag"}, "'format'"),
])
def test_malformed_tags_are_compile_errors(value: object, fragment: str) -> None:
    with pytest.raises(GrammarCompileError) as info:
        parse_structural_tag(value)  # type: ignore[arg-type]
    assert fragment in info.value.message


def test_a_tag_no_trigger_begins_is_an_error() -> None:
    fmt = {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        {"type": "tag", "begin": "<g>", "content": {"type": "const_string", "value": "x"},
         "end": ""}]}
    with pytest.raises(GrammarCompileError, match="starts with none of the triggers"):
        _writer().grammar(fmt)
