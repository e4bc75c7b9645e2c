"""Tests of numbers that are not integers (a `oneOf` of `integer` and `number`): the xgrammar
backend's rule (schema_xgrammar.py) accepts only such numbers, and every one it accepts is
not an integer to `jsonschema` either; llguidance narrows such branches away or refuses them
by place (drop_fraction_branches)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest

from vllm import StructuredOutputsParams
from vllm.exceptions import UnsupportedConstraintError
from vllm.v1.structured_output.schema.normalize import normalize_json_schema
from vllm.v1.structured_output.schema.facts import drop_fraction_branches, fraction_schema
from vllm.v1.structured_output.schema.for_xgrammar import adapt_for_xgrammar, check_xgrammar_support

ONE_OF = {"oneOf": [{"type": "integer"}, {"type": "number"}]}


def _accepts(backend: Any, tokenizer: Any, schema: Any, text: str) -> bool:
    grammar = backend.compile_grammar(StructuredOutputsParams(json=schema))
    # One token per character: the vocabulary's own merges do not matter here.
    ids = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
    return grammar.accept_tokens("t", ids + [backend.stop_token_ids[0]])


@pytest.mark.parametrize("text, ok", [
    ("1.5", True), ("-0.25", True), ("1234567.12345678", True), ("0.5", True),
    ("1", False), ("1.0", False), ("1.50", False), ("1e3", False), ("1.5e1", False),
    ("12345678.5", False), ("0.123456789", False), ('"1.5"', False),
])
def test_xgrammar_writes_numbers_that_are_not_integers(
    backend: Any, tokenizer: Any, text: str, ok: bool
) -> None:
    assert _accepts(backend, tokenizer, ONE_OF, text) == ok
    if ok:
        assert jsonschema.Draft202012Validator(ONE_OF).is_valid(json.loads(text))


@pytest.mark.parametrize("bounds, negative, positive", [
    ({"minimum": 0}, False, True),
    ({"exclusiveMaximum": 0}, True, False),
    ({"minimum": -1e9, "maximum": 1e9}, True, True),
])
def test_bounds_that_admit_a_whole_sign_keep_it(
    backend: Any, tokenizer: Any, bounds: dict[str, Any], negative: bool, positive: bool
) -> None:
    schema = {**fraction_schema(), **bounds}
    assert _accepts(backend, tokenizer, schema, "-2.5") == negative
    assert _accepts(backend, tokenizer, schema, "2.5") == positive


def test_other_bounds_are_refused_by_place() -> None:
    schema = normalize_json_schema({"type": "object", "properties": {"v": {
        "oneOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                  {"type": "number", "minimum": 0, "maximum": 100}]}}})
    adapt_for_xgrammar(schema)
    with pytest.raises(UnsupportedConstraintError, match="#/properties/v") as info:
        check_xgrammar_support(schema)
    assert "not an integer" in info.value.message


def test_a_forged_mark_is_not_taken() -> None:
    schema = normalize_json_schema({"anyOf": [ONE_OF, {"const": "vllm:fraction:both"}]})
    adapt_for_xgrammar(schema)
    # The fraction branch is dropped (narrower), the request's constant stays a string.
    assert schema["anyOf"] == [{"const": "vllm:fraction:both"}]


def test_fraction_branches_are_dropped_where_another_remains() -> None:
    schema = {"type": "object", "properties": {
        "a": {"anyOf": [fraction_schema(), {"type": "string"}]},
        "b": {"anyOf": [{"anyOf": [fraction_schema(), {"type": "null"}]}, fraction_schema()]},
    }, "not": {"anyOf": [fraction_schema(), {"type": "null"}]}}
    assert drop_fraction_branches(schema) is None
    assert schema["properties"]["a"]["anyOf"] == [{"type": "string"}]
    assert schema["properties"]["b"]["anyOf"] == [{"anyOf": [{"type": "null"}]}]
    assert len(schema["not"]["anyOf"]) == 2  # narrowing inside `not` would widen
    alone = {"properties": {"c": {"anyOf": [fraction_schema()]}}}
    assert drop_fraction_branches(alone) == "#/properties/c/anyOf/0"


def test_guidance_refuses_a_sole_fraction_by_place(guidance_backend: Any) -> None:
    schema = {"type": "object", "properties": {"v": ONE_OF}}
    with pytest.raises(UnsupportedConstraintError, match="#/properties/v") as info:
        guidance_backend.compile_grammar(StructuredOutputsParams(json=schema))
    assert "not an integer" in info.value.message


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"v": ONE_OF, "w": {"oneOf": [
        {"type": "integer", "minimum": 0}, {"type": "number", "minimum": 0}]}},
     "required": ["v", "w"]},
    {"type": "array", "items": {"not": {"type": "integer"}, "type": "number"}, "minItems": 2},
], ids=["object", "array"])
def test_walks_through_fractions_validate(
    schema: dict[str, Any], backend: Any, tokenizer: Any, walk_vocab: Any
) -> None:
    from tests.v1.structured_output.oracle import validate_json
    from tests.v1.structured_output.walker import random_walk

    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    for seed in range(8):
        grammar = backend.compile_grammar(params)
        tokens, stopped = random_walk(grammar, walk_vocab, np.random.default_rng(seed),
                                      finish_after=10)
        assert stopped
        validate_json(json.loads(tokenizer.decode(tokens[:-1])), schema)
