"""The proofs of the declared narrowings (narrowings.py): each names a refusal only when
its narrowed schema refuses the value, and a refusal no narrowing explains stays unexplained."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.v1.structured_output.differential import is_valid
from tests.v1.structured_output.narrowings import (
    CLOSED_ARRAYS,
    CLOSED_OBJECTS,
    CONTAINS_FIRST,
    FORMAT_SPELLING,
    FRACTION_BRANCH,
    LISTED_PROPERTY,
    NUMBER_SPELLING,
    ONE_OF_EXCLUSIVE,
    TOKEN_SPELLING,
    UNIQUE_ITEMS,
    Explainer,
    as_2020_12,
)
from tests.v1.structured_output.schema_gen import DRAFTS


def _refuse_all(text: str) -> bool:
    return False


def _explain(backend: str, value: Any, schema: dict[str, Any], accepts=_refuse_all,
             format_ok=lambda fmt, s: True, other=None) -> str:
    assert is_valid(value, schema)
    text = json.dumps(value, separators=(",", ":"))
    return Explainer(backend, format_ok).explain(value, text, schema, accepts, is_valid, other)


@pytest.mark.parametrize("value, schema, why", [
    ({"a": 1, "z": 2}, {"type": "object", "properties": {"a": {}}}, CLOSED_OBJECTS),
    # Listed by a sibling `allOf` member: not an unlisted property.
    ({"a": 1, "b": 2}, {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}, ""),
    ([1, 2], {"type": "array", "prefixItems": [{"type": "integer"}]}, CLOSED_ARRAYS),
    ([1, 2], {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     UNIQUE_ITEMS),
    (["b", "a"], {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True,
                  "minItems": 2}, UNIQUE_ITEMS),
    (["a", "b"], {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True,
                  "minItems": 2}, ""),
    ([1, 0], {"type": "array", "items": {"type": "integer"}, "contains": {"const": 0}},
     CONTAINS_FIRST),
    ([0, 1], {"type": "array", "items": {"type": "integer"}, "contains": {"const": 0}}, ""),
    # Closed where the value sits: the names inside `not` list nothing there.
    ({"z": 1}, {"not": {"type": "object", "properties": {"a": {"type": "string"}},
                        "required": ["a"]}}, CLOSED_OBJECTS),
])
def test_each_narrowing_names_only_what_it_refuses(value: Any, schema: dict[str, Any],
                                                   why: str) -> None:
    assert _explain("xgrammar", value, schema) == why


def test_backends_declare_their_own_narrowings() -> None:
    schema = {"type": "object", "properties": {"a": {}}}
    assert _explain("xgrammar", {"a": 1, "z": 2}, schema) == CLOSED_OBJECTS
    assert _explain("guidance", {"a": 1, "z": 2}, schema) == ""  # llguidance keeps it open
    schema["minProperties"] = 1
    assert _explain("guidance", {"z": 2}, schema) == LISTED_PROPERTY
    assert _explain("guidance", {"a": 1, "z": 2}, schema) == ""
    # llguidance has no schema for "a number that is not an integer".
    schema = {"not": {"type": "integer", "maximum": 5}}
    assert _explain("guidance", 0.5, schema) == FRACTION_BRANCH
    assert _explain("guidance", 6, schema) == ""


def test_spellings_formats_and_one_of() -> None:
    assert _explain("guidance", 1.5, {"type": "number"},
                    accepts=lambda t: t == "1.50") == NUMBER_SPELLING
    schema = {"type": "string", "format": "hostname"}
    assert _explain("xgrammar", "a_b", schema, format_ok=lambda f, s: "_" not in s) \
        == FORMAT_SPELLING
    assert _explain("xgrammar", "ab", schema, format_ok=lambda f, s: "_" not in s) == ""
    # A oneOf whose branches were made exclusive: the anyOf reading, or the one branch the
    # value matches, accepts it.
    schema = {"oneOf": [{"type": "string"}, {"type": "string", "pattern": "b$"}]}
    readings: list[Any] = []

    def other(reading: Any, text: str) -> bool:
        readings.append(reading)
        return "oneOf" not in json.dumps(reading) and "b$" not in json.dumps(reading)

    assert _explain("xgrammar", "x", schema, other=other) == ONE_OF_EXCLUSIVE
    assert {"anyOf": schema["oneOf"]} in readings
    assert _explain("xgrammar", "x", schema, other=lambda s, t: False) == ""
    # Also a `oneOf` inside an `anyOf` over the whole value.
    nested = {"anyOf": [schema, {"type": "boolean"}]}
    assert _explain("xgrammar", "x", nested, other=other) == ONE_OF_EXCLUSIVE


def test_drafts_are_read_in_2020_12() -> None:
    schema = {"$schema": DRAFTS["draft-04"], "type": "object", "propertyNames": {"maxLength": 1},
              "properties": {"n": {"type": "number", "minimum": 2, "exclusiveMinimum": True},
                             "t": {"items": [{"type": "string"}], "additionalItems": False}},
              "dependencies": {"n": ["t"]}}
    converted = as_2020_12(schema)
    assert "propertyNames" not in converted
    assert converted["properties"]["n"] == {"type": "number", "exclusiveMinimum": 2}
    assert converted["properties"]["t"] == {"prefixItems": [{"type": "string"}], "items": False}
    assert converted["dependentRequired"] == {"n": ["t"]}


def test_a_walk_refused_in_other_tokens_is_token_spelling() -> None:
    """The checker labels a walk's own text that the grammar refuses once re-encoded."""
    from tests.v1.structured_output.differential import Checker, Tally

    class Grammar:
        def validate_tokens(self, tokens: list[int]) -> list[int]:
            return tokens if tokens[:1] == [7] else []  # only the walk's own tokens

    class Backend:
        def compile_grammar(self, params: Any) -> Grammar:
            return Grammar()

    class Tokenizer:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [1]

        def decode(self, tokens: list[int]) -> str:
            return '"a"'

    import random

    from tests.v1.structured_output import differential

    walks = iter([([7, 9], True)] * 4)
    original = differential.random_walk
    differential.random_walk = lambda *args, **kwargs: next(walks)
    try:
        tally = Tally()
        checker = Checker("xgrammar", Backend(), Tokenizer(), None, eos_id=9)
        checker.check({"type": "string"}, random.Random(0), tally, num_instances=1)
    finally:
        differential.random_walk = original
    found = [(f.kind, f.text, f.detail) for f in tally.findings if f.text == '"a"']
    assert found == [("refused", '"a"', TOKEN_SPELLING)]
