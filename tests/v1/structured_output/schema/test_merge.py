"""Tests of JSON-schema intersections (schema_merge.py): `intersect` on probe values, `allOf`
members merged into one node (with their conditionals), keywords beside `anyOf` distributed,
and the recursive intersection llguidance gives up on avoided."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.exceptions import GrammarCompileError
from vllm.v1.structured_output.schema.normalize import check_xgrammar_support, normalize_json_schema
from vllm.v1.structured_output.schema.merge import MAX_BRANCHES, intersect

from tests.v1.structured_output.schema_strategies import DEFS, compare, combined_schemas, flat_schemas, json_values
from .test_one_of import PROBES

_SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))


@_SETTINGS
@given(flat_schemas(), flat_schemas(), st.lists(json_values, max_size=8))
def test_intersection_matches_exactly_what_both_match(
    a: dict[str, Any], b: dict[str, Any], extra: list[Any]
) -> None:
    root = {"$defs": DEFS}
    merged = intersect(a, b, root)
    if merged is None:
        return  # no single-schema form: the caller keeps `allOf`
    va, vb = (jsonschema.Draft202012Validator({**s, **root}) for s in (a, b))
    vm = jsonschema.Draft202012Validator({**merged, **root}) if merged is not False else None
    for value in PROBES + extra:
        got = vm.is_valid(value) if vm is not None else False
        assert got == (va.is_valid(value) and vb.is_valid(value)), (value, merged)


@_SETTINGS
@given(combined_schemas(exact_only=True), st.lists(json_values, max_size=8))
def test_merges_distributions_negations_and_conditionals_are_exact(
    schema: dict[str, Any], extra: list[Any]
) -> None:
    if "oneOf" not in schema:  # oneOf: test_schema_one_of
        compare(schema, PROBES + extra, exact=True)


@_SETTINGS
@given(combined_schemas(), st.lists(json_values, max_size=8))
def test_no_rewrite_accepts_what_the_schema_refuses(
    schema: dict[str, Any], extra: list[Any]
) -> None:
    compare(schema, PROBES + extra, exact=False)


def test_all_of_of_object_schemas_with_conditionals_becomes_one_node() -> None:
    """Each member brings properties or a conditional on the discriminator another member
    lists: merged, every `if` is rewritten against the merged properties."""
    schema = {"allOf": [
        {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}, "x": {}, "y": {}},
         "required": ["kind"]},
        {"if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["x"]}},
        {"if": {"properties": {"kind": {"const": "b"}}}, "then": {"required": ["y"]},
         "else": {"required": ["x"]}},
        {"properties": {"x": {"type": "integer"}}},
    ]}
    probes = PROBES + [{"kind": k, **extra} for k in "abcd"
                       for extra in ({}, {"x": 1}, {"y": 1}, {"x": "s"}, {"x": 1, "y": 1})]
    out = compare(schema, probes, exact=True)
    assert not {"if", "then", "else", "allOf"} & set(out)
    check_xgrammar_support(out)  # one anyOf of plain objects: xgrammar enforces it


def test_keywords_beside_any_of_are_distributed_into_its_branches() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}},
              "required": ["a"], "anyOf": [{"required": ["b"]}, {"required": ["c"]}]}
    probes = PROBES + [{"a": "s", "b": 1}, {"a": 1, "b": 1}, {"a": "s", "c": 1}, {"a": "s"}]
    out = compare(schema, probes, exact=True)
    assert set(out) == {"anyOf", "$schema"} and len(out["anyOf"]) == 2
    check_xgrammar_support(out)


def test_distribution_past_the_limit_is_left_for_llguidance() -> None:
    rules = [{"anyOf": [{"required": [f"a{i}"]}, {"required": [f"b{i}"]}]} for i in range(6)]
    assert 2 ** 6 > MAX_BRANCHES
    out = normalize_json_schema({"type": "object", "allOf": rules})
    # One rule is the node's own anyOf, the others stay beside it.
    assert len(out["allOf"]) == 5 and out["anyOf"] == rules[0]["anyOf"]


def test_all_of_with_nothing_in_common_is_an_error() -> None:
    with pytest.raises(GrammarCompileError, match=r"at #/properties/v: the members of 'allOf'"):
        normalize_json_schema({"properties": {"v": {"allOf": [{"type": "string"},
                                                              {"type": "integer"}]}}})


# Two references to one recursive definition, intersected: llguidance 1.x answered "Schema
# intersection stack level exceeded" for both.
_RECURSIVE = [
    {"$defs": {"n": {"type": "object", "properties": {"kid": {"$ref": "#/$defs/n"}},
                     "required": ["kid"]}},
     "type": "object", "properties": {"kid": {"$ref": "#/$defs/n"}},
     "allOf": [{"$ref": "#/$defs/n"}]},
    {"$defs": {"n": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
     "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
     "anyOf": [{"$ref": "#/$defs/n"}, {"required": ["x"]}]},
]


@pytest.mark.parametrize("schema", _RECURSIVE, ids=["all_of", "any_of"])
def test_intersections_of_one_recursive_definition_are_avoided(
    schema: dict[str, Any], backend: Any, guidance_backend: Any
) -> None:
    from vllm import StructuredOutputsParams

    out = normalize_json_schema(schema)
    check_xgrammar_support(out)
    for b in (backend, guidance_backend):
        b.compile_grammar(StructuredOutputsParams(json=schema))


_TWO_TREES = {"a": {"type": "object", "properties": {"kid": {"$ref": "#/$defs/a"},
                                                     "x": {"type": "integer"}}},
              "b": {"type": "object", "properties": {"kid": {"$ref": "#/$defs/b"},
                                                     "y": {"type": "string"}}}}


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": _TWO_TREES, "allOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]},
        {"$defs": _TWO_TREES, "$ref": "#/$defs/a",
         "anyOf": [{"$ref": "#/$defs/b"}, {"type": "object", "required": ["x"]}]},
    ],
    ids=["all_of", "beside_any_of"],
)
def test_intersecting_two_recursive_definitions_is_a_clear_refusal(
    schema: dict[str, Any]
) -> None:
    """Their intersection never ends: refused naming both, not llguidance's "Schema
    intersection stack level exceeded"."""
    from vllm.exceptions import UnsupportedConstraintError

    with pytest.raises(UnsupportedConstraintError, match="at #: the schemas '#/\\$defs/a' "
                       "and '#/\\$defs/b' would be intersected inside their own"):
        normalize_json_schema(schema)
