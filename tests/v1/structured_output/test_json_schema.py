"""Tests of the backend-neutral schema preparation and xgrammar's refusals (json_schema.py)."""

from __future__ import annotations

import itertools
from typing import Any

import jsonschema
import pytest

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.v1.structured_output.json_schema import (
    check_xgrammar_support,
    normalize_json_schema,
)

DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT4 = "http://json-schema.org/draft-04/schema#"


def test_legacy_drafts_drop_ref_siblings_and_new_drafts_keep_them() -> None:
    defs = {"base": {"type": "object", "properties": {"id": {"type": "integer"}}}}
    old = {"$schema": DRAFT7, "definitions": defs, "$ref": "#/definitions/base",
           "required": ["id"], "description": "kept out too"}
    out = normalize_json_schema(old)
    assert out == {"definitions": defs, "$ref": "#/definitions/base"}
    # The validator of the schema's own draft agrees: {} is valid, so dropping was exact.
    jsonschema.validators.validator_for(old)(old).validate({})
    new = {"$defs": defs, "$ref": "#/$defs/base", "required": ["id"]}
    assert normalize_json_schema(new)["required"] == ["id"]
    with pytest.raises(UnsupportedConstraintError, match=r"beside '\$ref' \(required\)"):
        check_xgrammar_support(normalize_json_schema(new))


def test_draft4_boolean_exclusive_bounds_become_numbers() -> None:
    schema = {"$schema": DRAFT4, "type": "number", "minimum": 0, "exclusiveMinimum": True,
              "maximum": 5, "exclusiveMaximum": False}
    out = normalize_json_schema(schema)
    assert out["exclusiveMinimum"] == 0 and "minimum" not in out
    assert out["maximum"] == 5 and "exclusiveMaximum" not in out


def test_array_form_items_become_prefix_items() -> None:
    out = normalize_json_schema(
        {"type": "array", "items": [{"type": "string"}, {"type": "integer"}],
         "additionalItems": False}
    )
    assert out["prefixItems"] == [{"type": "string"}, {"type": "integer"}]
    assert out["items"] is False and "additionalItems" not in out


def test_unknown_formats_are_annotations_and_known_ones_stay() -> None:
    out = normalize_json_schema({"type": "object", "properties": {
        "c": {"type": "string", "format": "color"},
        "d": {"type": "string", "format": "date"},
    }})
    assert "format" not in out["properties"]["c"]
    assert out["properties"]["d"]["format"] == "date"


@pytest.mark.parametrize(
    "branches",
    [
        [{"type": "string"}, {"type": "integer"}, {"type": "null"}],
        [{"const": "a"}, {"const": "b"}, {"enum": ["c", 1]}],
        [
            {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "cat"}}},
            {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "dog"}}},
        ],
        [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
        [{"type": "array"}, {"type": "object", "required": ["x"],
                             "properties": {"x": {"type": "string"}}}],
    ],
    ids=["types", "consts", "discriminator", "refs", "array_vs_object"],
)
def test_provably_disjoint_one_of_becomes_any_of(branches: list[Any]) -> None:
    schema = {"$defs": {"a": {"type": "string"}, "b": {"type": "boolean"}}, "oneOf": branches}
    out = normalize_json_schema(schema)
    assert "oneOf" not in out and out["anyOf"] == branches


def test_discriminator_needs_objects_only() -> None:
    """`required` holds vacuously for non-objects: 5 matches both branches unless the schema
    says the value is an object."""
    branches = [
        {"required": ["k"], "properties": {"k": {"const": 1}}},
        {"required": ["k"], "properties": {"k": {"const": 2}}},
    ]
    with pytest.raises(UnsupportedConstraintError, match="may overlap"):
        normalize_json_schema({"oneOf": branches})
    assert "anyOf" in normalize_json_schema({"type": "object", "oneOf": branches})


@pytest.mark.parametrize(
    "branches",
    [
        [{"type": "number"}, {"type": "integer"}],
        [{"type": "string"}, {"type": "string", "maxLength": 3}],
        [{"required": ["a"]}, {"type": "object", "properties": {"a": {"type": "string"}}}],
        [{"$ref": "https://example.com/remote.json"}, {"type": "string"}],
    ],
    ids=["number_integer", "same_type", "required_vs_properties", "remote_ref"],
)
def test_overlapping_one_of_is_refused_unless_coerced(branches: list[Any]) -> None:
    with pytest.raises(UnsupportedConstraintError, match=r"at #: 'oneOf' branches may overlap"):
        normalize_json_schema({"oneOf": branches})
    assert normalize_json_schema({"oneOf": branches}, one_of_as_any_of=True) == {
        "anyOf": branches
    }


def test_one_of_beside_any_of_keeps_both() -> None:
    out = normalize_json_schema({"anyOf": [{"type": "string"}, {"type": "integer"}],
                                 "oneOf": [{"const": "a"}, {"const": 1}]})
    assert out["allOf"] == [{"anyOf": [{"const": "a"}, {"const": 1}]}]


def test_nested_one_of_is_checked_with_its_location() -> None:
    schema = {"type": "object", "properties": {
        "v": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}}
    with pytest.raises(UnsupportedConstraintError, match="#/properties/v"):
        normalize_json_schema(schema)


def test_unsatisfiable_schemas_are_plain_grammar_errors() -> None:
    with pytest.raises(GrammarCompileError) as info:
        normalize_json_schema({"type": "integer", "minimum": 3, "maximum": 2})
    assert not isinstance(info.value, UnsupportedConstraintError)
    assert info.value.param == "structured_outputs.json"


@pytest.mark.parametrize(
    "schema, fragment",
    [
        ({"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
         "beside 'anyOf' (type)"),
        ({"type": "string", "format": "ipv4", "maxLength": 9}, "minLength/maxLength"),
        ({"type": "array", "minItems": 2, "uniqueItems": True}, "uniqueItems"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"allOf": [{"type": "integer"}, {"minimum": 1}]}, "allOf"),
        ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
        ({"type": "object", "properties": {"s": {"type": "array", "uniqueItems": True,
                                                 "minItems": 3}}},
         "#/properties/s"),
    ],
)
def test_xgrammar_refuses_what_it_would_drop(schema: dict[str, Any], fragment: str) -> None:
    with pytest.raises(UnsupportedConstraintError, match="unsupported by xgrammar") as info:
        check_xgrammar_support(normalize_json_schema(schema))
    assert fragment in str(info.value)


def test_xgrammar_accepts_annotations_beside_combinators() -> None:
    schema = {"description": "nullable", "title": "t",
              "anyOf": [{"type": "string"}, {"type": "null"}]}
    check_xgrammar_support(normalize_json_schema(schema))


# Values to compare a rewritten schema with its original on: objects with every subset of
# the properties a, b, c (as strings or numbers), and one value of each other type.
_PROBES: list[Any] = [None, True, 3, 2.5, "s", [1]] + [
    {name: value for name, value in zip("abc", values) if value is not None}
    for values in itertools.product([None, 0, 1, "0", True], repeat=3)
]


@pytest.mark.parametrize(
    "schema",
    [
        {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b", "c"]},
                                     {"type": "object", "required": ["c"]}]},
        {"type": "object", "dependentRequired": {"a": ["b"], "c": ["a", "b"]}},
        {"$schema": DRAFT7, "dependencies": {"a": ["c"], "b": {"required": ["c"]}}},
        {"dependentSchemas": {"a": {"properties": {"b": {"type": "string"}}}}},
        {"not": {"required": ["a", "b"]}},
        {"type": "object", "properties": {"a": {"enum": [0, 1, "0"]}},
         "if": {"properties": {"a": {"const": "0"}}, "required": ["a"]},
         "then": {"required": ["b"]}, "else": {"properties": {"c": False}}},
        {"properties": {"a": {"type": "boolean"}, "c": {"type": "integer"}},
         "if": {"properties": {"a": {"const": True}}}, "then": {"required": ["c"]}},
    ],
    ids=["two_required", "three_with_type", "dependent_required",
         "draft7_dependencies", "dependent_schemas", "not_required", "if_then_else",
         "if_boolean"],
)
def test_rewrites_accept_exactly_what_the_original_accepts(schema: dict[str, Any]) -> None:
    out = normalize_json_schema(schema)
    rewritten_keywords = {"oneOf", "dependencies", "dependentRequired", "dependentSchemas",
                          "not", "if", "then", "else"}
    assert not rewritten_keywords & set(out)
    original = jsonschema.validators.validator_for(schema)(schema)
    rewritten = jsonschema.Draft202012Validator(out)
    for value in _PROBES:
        assert original.is_valid(value) == rewritten.is_valid(value), value


@pytest.mark.parametrize(
    "schema, max_items",
    [
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, 1),
        ({"type": "array", "minItems": 1, "maxItems": 5, "uniqueItems": True}, 1),
        ({"type": "array", "maxItems": 0, "uniqueItems": True}, 0),
        ({"type": "array", "minItems": 2, "uniqueItems": True}, None),
    ],
)
def test_unique_items_is_enforced_by_at_most_one_item(
    schema: dict[str, Any], max_items: int | None
) -> None:
    out = normalize_json_schema(schema)
    if max_items is None:  # two or more unique items: left for the backends to refuse
        assert out["uniqueItems"] is True and "maxItems" not in out
        return
    assert "uniqueItems" not in out and out["maxItems"] == max_items
    original = jsonschema.Draft202012Validator(schema)
    for value in ([], ["a"], ["a", "a"], ["a", "b"]):
        # Narrower, never wider: what the rewrite accepts, the original accepts.
        if jsonschema.Draft202012Validator(out).is_valid(value):
            assert original.is_valid(value), value


def test_conditions_that_cannot_be_negated_are_left_for_the_backends() -> None:
    # `a` is any string: "a is not 'x'" has no schema without `not`.
    schema = {"properties": {"a": {"type": "string"}},
              "if": {"properties": {"a": {"const": "x"}}}, "then": {"required": ["b"]}}
    out = normalize_json_schema(schema)
    assert out["if"] == schema["if"]
    with pytest.raises(UnsupportedConstraintError, match="'if'"):
        check_xgrammar_support(out)
