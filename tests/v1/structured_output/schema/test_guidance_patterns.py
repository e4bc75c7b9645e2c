"""Tests for vllm/v1/structured_output/schema/guidance_patterns.py: JSON-schema patterns with a
negated class that excludes `"` or `\\` are refused by the llguidance backend (which would
let the escaped character through), and every other pattern still compiles."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.v1.structured_output.conftest import EOS_IDS
from vllm.exceptions import UnsupportedConstraintError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.schema.guidance_patterns import find_escape_blind_pattern

REFUSED = [r'^[^"]+$', r"^[^\\]*$", r'[^"\\]', r'^[^ab"]{2,}$', r"^(x|[^\\/]+)$", r'[^\x22]']
KEPT = [r"^[a-z]+$", r'^[a-z"]+$', r"^[^a]+$", r"^.+$", r"^[^\n]*$", r"\S+", r"^[^/]+$",
        r"^[#-~]+$", r"(unparsable"]


@pytest.mark.parametrize("pattern", REFUSED)
def test_negated_classes_without_quote_or_backslash_are_found(pattern: str) -> None:
    schema = {"type": "object", "properties": {"path": {"type": "string", "pattern": pattern}}}
    assert find_escape_blind_pattern(schema) == "#/properties/path/pattern"


@pytest.mark.parametrize("pattern", KEPT)
def test_other_patterns_are_not(pattern: str) -> None:
    assert find_escape_blind_pattern({"type": "string", "pattern": pattern}) is None


def test_patterns_are_found_anywhere() -> None:
    schema = {"$defs": {"a": {"items": [{"pattern": "ok"}, {"pattern": '[^"]'}]}}}
    assert find_escape_blind_pattern(schema) == "#/$defs/a/items/1/pattern"
    names = {"patternProperties": {"^[^\\\\]+$": {"type": "integer"}}}
    assert find_escape_blind_pattern(names) == "#/patternProperties"
    # A property that is merely named "pattern" holds a schema, not a pattern.
    assert find_escape_blind_pattern(
        {"properties": {"pattern": {"type": "string"}}}) is None


def _accepts(backend: Any, tokenizer: Any, schema: dict, value: str) -> bool:
    grammar = backend.compile_grammar(StructuredOutputsParams(json=schema))
    tokens = tokenizer.encode(json.dumps(value), add_special_tokens=False) + [EOS_IDS[0]]
    return grammar.accept_tokens("r", tokens)


def test_the_guidance_backend_refuses_them_and_keeps_the_rest(
    guidance_backend: Any, tokenizer: Any
) -> None:
    schema = {"type": "string", "pattern": r'^[^"]+$'}
    with pytest.raises(UnsupportedConstraintError) as info:
        guidance_backend.compile_grammar(StructuredOutputsParams(json=schema))
    assert info.value.param == "structured_outputs.json"
    assert "#/pattern" in str(info.value)
    kept = {"type": "string", "pattern": r"^[^x]+$"}
    for value in ['a"b', "a\\b", "ab", "axb"]:
        assert _accepts(guidance_backend, tokenizer, kept, value) == (
            re.fullmatch(r"[^x]+", value) is not None), value
