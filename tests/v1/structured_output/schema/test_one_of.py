"""Tests of `oneOf` as an exclusive `anyOf` (schema_one_of.py), checked on probe values
with `jsonschema`: never accepting a value the `oneOf` refuses, and accepting the same
values where the rewrite is exact."""

from __future__ import annotations

import itertools
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.exceptions import UnsupportedConstraintError
from vllm.v1.structured_output.schema.normalize import normalize_json_schema
from vllm.v1.structured_output.schema.one_of import MAX_PIECES

from tests.v1.structured_output.schema_strategies import NAMES, compare, flat_schemas, json_values

DRAFT2020 = "https://json-schema.org/draft/2020-12/schema"

# Every scalar the strategies use, and objects with every subset of the names a, b, c.
PROBES: list[Any] = [None, True, False, -1, 0, 1, 2, 2.5, 3, 10, "", "a", "ab", "admin", "b",
                     [], [1], [1, "a"]] + [
    {n: v for n, v in zip(NAMES, values) if v is not None}
    for values in itertools.product([None, 0, "a", 2.5], repeat=3)
]
_SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))


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
        [{"type": "number", "maximum": 0}, {"type": "number", "exclusiveMinimum": 0}],
        [{"type": "object", "properties": {"a": {}}, "additionalProperties": False},
         {"type": "object", "required": ["b"]}],
        [{"type": "object", "required": ["v"], "properties": {"v": {"minimum": 5}}},
         {"type": "object", "required": ["v"], "properties": {"v": {"type": "integer",
                                                                    "maximum": 4}}}],
        [{"type": "string", "maxLength": 2}, {"type": "string", "minLength": 3}],
    ],
    ids=["types", "consts", "discriminator", "refs", "array_vs_object", "ranges",
         "closed_names", "property_ranges", "lengths"],
)
def test_provably_disjoint_one_of_becomes_any_of(branches: list[Any]) -> None:
    schema = {"$defs": {"a": {"type": "string"}, "b": {"type": "boolean"}}, "oneOf": branches}
    out = normalize_json_schema(schema)
    assert "oneOf" not in out and out["anyOf"] == branches


@pytest.mark.parametrize(
    "schema",
    [
        # A discriminator that non-objects satisfy vacuously: 5 matches both branches.
        {"oneOf": [{"required": ["k"], "properties": {"k": {"const": 1}}},
                   {"required": ["k"], "properties": {"k": {"const": 2}}}]},
        {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 1}]},
        {"oneOf": [{"required": ["a"]},
                   {"type": "object", "properties": {"a": {"type": "string"}}}]},
        {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                   {"type": "object", "properties": {"b": {}}, "required": ["a", "b"]}]},
        {"oneOf": [{"minimum": 0, "maximum": 10}, {"minimum": 5}]},
        {"oneOf": [{"enum": ["a", "b", 1]}, {"type": "string"}]},
        {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b", "c"]},
                                     {"type": "object", "required": ["c"]}]},
        {"oneOf": [{"type": ["string", "null"]}, {"type": ["null", "boolean"]}]},
    ],
    ids=["vacuous_discriminator", "same_type", "required_vs_properties", "one_inside_other",
         "overlapping_ranges", "enum_vs_type", "two_required", "three_with_type",
         "type_lists"],
)
def test_overlapping_branches_are_made_exclusive_exactly(schema: dict[str, Any]) -> None:
    probes = PROBES + [{"k": 1}, {"k": 2}, {"k": 3}]
    out = compare(schema, probes, exact=True)
    assert out is not None and "oneOf" not in out
    # Not vacuous: some probe passes.
    assert any(jsonschema.Draft202012Validator(out).is_valid(v) for v in probes)


@pytest.mark.parametrize(
    "branches",
    [
        [{"type": "object", "properties": {"command": {"type": "string"}},
          "required": ["command"]},
         {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}],
        [{"type": "string"},
         {"type": "object", "properties": {"version": {"type": "string"}},
          "required": ["version"]},
         {"type": "object", "properties": {"git": {"type": "string"}}, "required": ["git"]},
         {"type": "object", "required": ["path", "a"]}],
        [{"type": "object", "properties": {"a": {}, "b": {}}, "additionalProperties": False},
         {"type": "object", "properties": {"b": {}, "c": {}}, "additionalProperties": False}],
    ],
    ids=["two_objects", "string_and_objects", "closed_objects_sharing_a_name"],
)
def test_object_branches_never_accept_what_one_of_refuses(branches: list[Any]) -> None:
    probes = PROBES + [{"command": "x"}, {"url": "u"}, {"command": "x", "url": "u"},
                       {"version": "1"}, {"git": "g"}, {"path": "p", "a": 1},
                       {"version": "1", "git": "g"}, {"command": 5, "url": "u"}]
    out = compare({"oneOf": branches}, probes, exact=False)
    assert out is not None and "oneOf" not in out


@pytest.mark.parametrize(
    "branches, pair",
    [
        ([{"type": "string", "format": "date"}, {"type": "string"}],
         "#/oneOf/0 and #/oneOf/1"),
        ([{"type": "null"}, {"type": "string"}, {"type": "string", "pattern": "^a.*$"}],
         "#/oneOf/1 and #/oneOf/2"),
        ([{"$ref": "https://example.com/remote.json"}, {"type": "string"}],
         "#/oneOf/0 and #/oneOf/1"),
    ],
    ids=["format", "pattern", "remote_ref"],
)
def test_branches_that_cannot_be_made_exclusive_are_refused_by_name(
    branches: list[Any], pair: str
) -> None:
    """A string not of a format, or not matching a pattern, has no schema: the error names
    the two branches; `one_of_as_any_of` accepts them as anyOf."""
    with pytest.raises(UnsupportedConstraintError, match="may overlap") as info:
        normalize_json_schema({"oneOf": branches})
    assert f"at #: 'oneOf' branches {pair}" in info.value.message
    assert normalize_json_schema({"oneOf": branches}, one_of_as_any_of=True) == {
        "anyOf": branches, "$schema": DRAFT2020
    }


def test_nested_one_of_is_refused_with_its_location() -> None:
    schema = {"type": "object", "properties": {
        "v": {"oneOf": [{"type": "string"}, {"type": "string", "pattern": "^a"}]}}}
    with pytest.raises(UnsupportedConstraintError, match="#/properties/v/oneOf/1"):
        normalize_json_schema(schema)


@pytest.mark.parametrize("branches", [
    [{"type": "number"}, {"type": "integer"}],
    [{"type": "integer"}, {"type": "number", "minimum": 0}],
    [{"type": "integer"}, {"type": "number"}, {"type": "string"}],
], ids=["number_integer", "bounded", "with_string"])
def test_integer_beside_number_keeps_the_numbers_that_are_not_integers(
    branches: list[Any]
) -> None:
    """An integer matches both branches, so only the other numbers stay: written with
    `not` of `integer` (fraction_schema), exactly."""
    out = compare({"oneOf": branches}, PROBES + [0.5, -2.5, 1.0, 7.25, "x"], exact=True)
    assert out is not None
    assert {"type": "integer"} in [b.get("not") for b in out["anyOf"]]


def test_many_overlapping_branches_keep_one_refusal_each() -> None:
    """Written out exactly, each of 12 overlapping branches would split in two per other
    branch; past MAX_PIECES alternatives each keeps one way of refusing each other branch
    (that other branch's required name is absent): narrower, still exclusive."""
    branches = [{"type": "object", "properties": {f"p{i}": {"enum": [0, 1]}},
                 "required": [f"p{i}"]} for i in range(12)]
    probes = [{f"p{i}": 0} for i in range(12)] + [{"p0": 0, "p1": 1}, {"p0": 5}, {}]
    out = compare({"oneOf": branches}, probes, exact=False)
    assert len(out["anyOf"]) == 12
    assert all(jsonschema.Draft202012Validator(out).is_valid({f"p{i}": 0}) for i in range(12))


def test_too_many_branches_is_a_named_limit() -> None:
    branches = [{"type": "object", "required": [f"p{i}"]} for i in range(MAX_PIECES + 1)]
    with pytest.raises(UnsupportedConstraintError, match=f"more than {MAX_PIECES} alternatives"):
        normalize_json_schema({"oneOf": branches})


def test_one_of_beside_any_of_is_distributed() -> None:
    schema = {"anyOf": [{"type": "string"}, {"type": "integer"}],
              "oneOf": [{"const": "a"}, {"const": 1}]}
    out = compare(schema, PROBES + ["a", 1], exact=True)
    # Each branch's value, with the type it satisfies folded in (rewrites.fold_enums).
    assert out["anyOf"] == [{"enum": ["a"]}, {"enum": [1]}]


@_SETTINGS
@given(st.lists(flat_schemas(exact_only=True), min_size=2, max_size=3),
       st.lists(json_values, max_size=8))
def test_exclusive_rewrites_are_exact_when_every_negation_is(
    branches: list[Any], extra: list[Any]
) -> None:
    # "integer" has no exact negation among numbers.
    exact = "integer" not in str(branches)
    compare({"oneOf": branches}, PROBES + extra, exact=exact)


@_SETTINGS
@given(st.lists(flat_schemas(), min_size=2, max_size=3), st.lists(json_values, max_size=8))
def test_rewrites_never_accept_what_one_of_refuses(branches: list[Any], extra: list[Any]) -> None:
    compare({"type": "object", "oneOf": branches}, PROBES + extra, exact=False)


def test_a_branch_of_listed_values_keeps_those_the_other_refuses() -> None:
    """Checked value by value, also against a pattern (which has no written negation)."""
    schema = {"oneOf": [{"enum": ["ab", "b1", "c", 7]},
                        {"type": "string", "pattern": "^[a-z]+$"}]}
    out = compare(schema, PROBES + ["ab", "b1", "c", 7, "zz", "Z"], exact=False)
    assert {"const": "b1"} in out["anyOf"] or {"enum": ["b1", 7]} in out["anyOf"]
    validator = jsonschema.Draft202012Validator(out)
    assert validator.is_valid("b1") and validator.is_valid(7) and not validator.is_valid("ab")


@pytest.mark.parametrize("branches", [
    [{"type": "array", "items": {"type": "string"}}, {"type": "array",
                                                      "items": {"type": "integer"}}],
    [{"type": "array", "prefixItems": [{"type": "string"}]},
     {"type": "array", "items": {"type": "integer"}}],
], ids=["items", "prefix_items"])
def test_arrays_of_different_items_keep_the_arrays_only_one_accepts(
    branches: list[Any]
) -> None:
    """The empty array matches both branches; an array holding an item one branch refuses
    matches only the other (`items` negated as `contains`, narrowed to a leading item)."""
    probes = PROBES + [["a", "b"], [1, 2], ["a", 1], [1, "a"], [2.5]]
    out = compare({"oneOf": branches}, probes, exact=False)
    assert out is not None
    rewritten = jsonschema.Draft202012Validator(out)
    assert rewritten.is_valid([1, 2]) and not rewritten.is_valid([])
