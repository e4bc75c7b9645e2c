"""Tests of the backend-neutral schema preparation and xgrammar's refusals (json_schema.py)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.v1.structured_output.schema.normalize import (
    check_xgrammar_support,
    normalize_json_schema,
    spell_out_min_properties,
)
from vllm.v1.structured_output.schema.patterns import anchor

DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT2020 = "https://json-schema.org/draft/2020-12/schema"


def test_legacy_drafts_drop_ref_siblings_and_new_drafts_keep_them() -> None:
    defs = {"base": {"type": "object", "properties": {"id": {"type": "integer"}}}}
    old = {"$schema": DRAFT7, "definitions": defs, "$ref": "#/definitions/base",
           "required": ["id"], "description": "kept out too"}
    out = normalize_json_schema(old)
    assert out == {"definitions": defs, "$ref": "#/definitions/base", "$schema": DRAFT2020}
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


def test_unsatisfiable_schemas_are_plain_grammar_errors() -> None:
    with pytest.raises(GrammarCompileError) as info:
        normalize_json_schema({"type": "integer", "minimum": 3, "maximum": 2})
    assert not isinstance(info.value, UnsupportedConstraintError)
    assert info.value.param == "structured_outputs.json"


@pytest.mark.parametrize(
    "schema, fragment",
    [
        ({"type": "object", "anyOf": [{"required": ["a"]}, {"not": {"required": ["b"]}}],
          "properties": {"a": {"type": "string", "pattern": "^a"}, "b": {"pattern": "^b"}},
          "minProperties": 1, "allOf": [{"properties": {"a": {"pattern": "a$"}}}]},
         "beside 'anyOf'"),
        ({"type": "string", "format": "email", "maxLength": 9}, "minLength/maxLength"),
        ({"type": "array", "minItems": 2, "uniqueItems": True}, "uniqueItems"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        # xgrammar 0.2.9 accepted "..x" here (found by a corpus walk).
        ({"type": "object", "patternProperties": {r"^\.(/.*)?$": {}},
          "additionalProperties": False}, "optional group holding an unbounded repeat"),
        ({"type": "string", "pattern": r"^a(?:x[a-z]+)?$"}, "optional group"),
        # xgrammar 0.2.9 enforced the format alone: "ftp://a.b" passed.
        ({"type": "string", "format": "uri", "pattern": "^https?://"},
         "'pattern' combined with 'format'"),
        ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "allOf"),
        ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False,
          "dependentSchemas": {"a": {"properties": {"b": {}}}}}, "unevaluatedProperties"),
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
    # "a does not match ^x" has no schema without `not`.
    schema = {"properties": {"a": {"type": "string"}},
              "if": {"properties": {"a": {"pattern": "^x"}}}, "then": {"required": ["b"]}}
    out = normalize_json_schema(schema)
    assert out["if"] == schema["if"]
    with pytest.raises(UnsupportedConstraintError, match="'if'"):
        check_xgrammar_support(out)


def _compare(schema: dict[str, Any], probes: list[Any], exact: bool) -> dict[str, Any]:
    """Normalizes `schema` and checks the result on `probes` against the schema's own draft:
    equal verdicts when `exact`, else never accepting what the original refuses. Returns the
    normalized schema; at least one probe must pass it (the check is not vacuous)."""
    out = normalize_json_schema(schema)
    original = jsonschema.validators.validator_for(schema)(schema)
    rewritten = jsonschema.Draft202012Validator(out)
    passed = 0
    for value in probes:
        got = rewritten.is_valid(value)
        passed += got
        if exact:
            assert got == original.is_valid(value), value
        elif got:
            assert original.is_valid(value), value
    assert passed
    return out


_KEY_PROBES: list[Any] = [{}, [], "x"] + [
    {key: 1 for key in keys}
    for n in range(3) for keys in itertools.combinations(["a", "bb", "ccc", "Z", "b-1"], n)
] + [{"a": "s"}, {"bb": "s", "Z": 2}]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
        {"type": "object", "propertyNames": {"maxLength": 2},
         "additionalProperties": {"type": "integer"}},
        {"type": "object", "propertyNames": {"minLength": 2, "maxLength": 3}},
        {"type": "object", "properties": {"a": {"type": "integer"}, "bb": {}},
         "propertyNames": {"pattern": "^[a-z]"}},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": False,
         "propertyNames": {"pattern": "^a"}},
        {"type": "object", "propertyNames": {"enum": ["a", "b"]},
         "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {"a": {"type": "string"}},
         "propertyNames": {"enum": ["a", "bb"]}},
    ],
    ids=["pattern", "length_with_extra_schema", "length_range", "listed_keys_match",
         "closed_object", "names_with_extra_schema", "names_beside_listed"],
)
def test_property_names_become_pattern_properties(schema: dict[str, Any]) -> None:
    out = _compare(schema, _KEY_PROBES, exact=True)
    assert "propertyNames" not in out


def test_property_names_that_cannot_be_rewritten_stay() -> None:
    for schema in [
        {"properties": {"A": {}}, "propertyNames": {"pattern": "^[a-z]+$"}},  # listed key fails
        {"propertyNames": {"pattern": "^a", "maxLength": 3}},
        {"properties": {"a": {}}, "additionalProperties": {"type": "string"},
         "propertyNames": {"pattern": "^a"}},
        {"propertyNames": {"enum": ["a", 1]}},
    ]:
        # It stays; its pattern is only written to match whole names (patterns.anchor).
        want = dict(schema["propertyNames"])
        if "pattern" in want:
            want["pattern"] = anchor(want["pattern"])
        assert normalize_json_schema(schema)["propertyNames"] == want


@pytest.mark.parametrize(
    ("schema", "exact"),
    [
        ({"type": "object", "properties": {"a": {}, "bb": {}}, "additionalProperties": False,
          "minProperties": 1}, True),
        ({"type": "object", "properties": {"a": {}}, "required": ["a"], "minProperties": 1},
         True),
        ({"type": "object", "properties": {"a": {}, "bb": {}}, "minProperties": 1}, False),
    ],
    ids=["closed", "required", "open"],
)
def test_min_properties_one(schema: dict[str, Any], exact: bool) -> None:
    """For llguidance (normalize_json_schema drops only the redundant case, xgrammar
    enforces the others itself)."""
    out = normalize_json_schema(schema)
    assert ("minProperties" in out) == ("required" not in schema)
    spell_out_min_properties(out)
    assert "minProperties" not in out
    original = jsonschema.validators.validator_for(schema)(schema)
    rewritten = jsonschema.Draft202012Validator(out)
    assert any(rewritten.is_valid(v) for v in _KEY_PROBES)
    for value in _KEY_PROBES:
        if exact:
            assert rewritten.is_valid(value) == original.is_valid(value), value
        elif rewritten.is_valid(value):
            assert original.is_valid(value), value


def test_normalized_schemas_are_read_as_2020_12() -> None:
    """The result uses 2020-12 keywords (prefixItems), so it must say so: llguidance reads a
    draft-07 schema's prefixItems as an unknown keyword."""
    out = normalize_json_schema({"$schema": DRAFT7, "type": "array", "items": [{"const": 1}]})
    assert out["$schema"] == DRAFT2020 and out["prefixItems"] == [{"const": 1}]


def test_unevaluated_properties_beside_all_of() -> None:
    schema = {
        "$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}},
                           "required": ["a"]}},
        "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"bb": {"type": "integer"}}},
                  {"patternProperties": {"^Z$": {}}}],
        "unevaluatedProperties": False,
    }
    out = _compare(schema, _KEY_PROBES, exact=True)
    assert out["additionalProperties"] is False and "unevaluatedProperties" not in out
    open_schema = {**schema, "allOf": [*schema["allOf"], {"additionalProperties": True}]}
    assert "unevaluatedProperties" not in _compare(open_schema, _KEY_PROBES, exact=True)
    conditional = {**schema, "anyOf": [{"required": ["a"]}, {"required": ["bb"]}]}
    assert normalize_json_schema(conditional)["unevaluatedProperties"] is False


_ITEM = {"type": "object", "properties": {"role": {"enum": ["owner", "member"]}},
         "required": ["role"]}
_OWNER = {"type": "object", "properties": {"role": {"const": "owner"}}, "required": ["role"]}
_ROLE_PROBES: list[Any] = [
    [{"role": r} for r in roles]
    for n in range(5) for roles in itertools.product(["owner", "member"], repeat=n)
]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "items": _ITEM, "contains": _OWNER},
        {"type": "array", "items": _ITEM, "contains": _OWNER, "minContains": 2},
        {"type": "array", "items": _ITEM, "contains": _OWNER, "maxContains": 1},
        {"type": "array", "items": _ITEM, "contains": _OWNER, "minContains": 2,
         "maxContains": 3},
        {"$schema": DRAFT7, "type": "array", "items": {"enum": ["build", "lint"]},
         "uniqueItems": True, "contains": {"const": "build"}},
    ],
    ids=["contains", "min_contains", "max_contains", "min_and_max", "draft7_unique"],
)
def test_contains_becomes_leading_matches(schema: dict[str, Any]) -> None:
    probes = _ROLE_PROBES + [[], ["build"], ["lint", "build"], ["build", "lint"]]
    out = _compare(schema, probes, exact=False)
    assert not {"contains", "minContains", "maxContains"} & set(out)


def test_contains_that_cannot_be_rewritten_stays() -> None:
    # maxContains over free strings: "the rest do not match" has no schema without `not`.
    schema = {"type": "array", "items": {"type": "string"}, "contains": {"const": "x"},
              "maxContains": 1}
    assert normalize_json_schema(schema)["contains"] == {"const": "x"}


# Schemas each rewrite of normalize_json_schema reshapes (overlapping oneOf branches made
# exclusive, `not` written out, allOf members and their conditionals merged, keywords beside
# anyOf distributed, an unreferenced definition that would be refused).
_WALKED = [
    {"type": "object", "properties": {"v": {"oneOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": [1, 2]}},
         "required": ["b"]}]}}, "required": ["v"]},
    {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "integer",
                                                                 "minimum": 5}]},
    {"oneOf": [{"enum": ["a", "b", 1]}, {"type": "string", "maxLength": 2}]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6,
                                               "not": {"enum": ["admin", "root"]}}},
     "required": ["name"], "additionalProperties": False},
    {"allOf": [
        {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "x": {"type": "integer"},
                                          "y": {"type": "boolean"}},
         "required": ["kind"], "additionalProperties": False},
        {"if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["x"]},
         "else": {"required": ["y"]}}]},
    {"type": "object", "properties": {"p": {"type": "integer"}, "q": {"type": "string"}},
     "additionalProperties": False, "anyOf": [{"required": ["p"]}, {"required": ["q"]}]},
    {"$defs": {"unused": {"oneOf": [{"type": "string"}, {"type": "string", "pattern": "^a"}]}},
     "type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "string", "pattern": r"^(?!-)[a-z0-9-]{1,8}(?<!-)$"},
    {"type": "string", "pattern": r"^(?=.*[a-z])(?=.*[0-9]).+$", "maxLength": 4},
    {"type": "object", "patternProperties": {r"^\.(/.*)?$": {"type": "null"}},
     "additionalProperties": False},
    {"oneOf": [{"type": "array", "items": {"type": "string"}, "maxItems": 3},
               {"type": "array", "items": {"type": "integer"}, "maxItems": 3}]},
    {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"},
                                                     {"type": "number"}]}},
     "required": ["v"]},
]


@pytest.mark.slow
@pytest.mark.parametrize("schema", _WALKED, ids=["objects", "ranges", "enum_vs_strings",
                                                 "not_enum", "all_of_if", "any_of_siblings",
                                                 "unused_definition", "dns_label", "password",
                                                 "optional_group", "array_items",
                                                 "integer_number"])
def test_walks_through_rewritten_schemas_validate_with_both_backends(
    schema: dict[str, Any], backend: Any, guidance_backend: Any, tokenizer: Any,
    walk_vocab: Any,
) -> None:
    """Every output a random walk through either backend's grammar finishes validates
    against the original schema (jsonschema)."""
    import numpy as np

    from tests.v1.structured_output.oracle import validate_json
    from tests.v1.structured_output.walker import random_walk
    from vllm import StructuredOutputsParams

    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    compiled = 0
    for b in (backend, guidance_backend):
        try:
            b.compile_grammar(params)
        except UnsupportedConstraintError:
            continue  # the other backend enforces it
        compiled += 1
        for seed in range(6):
            grammar = b.compile_grammar(params)
            tokens, stopped = random_walk(grammar, walk_vocab, np.random.default_rng(seed),
                                          finish_after=40)
            assert stopped
            validate_json(json.loads(tokenizer.decode(tokens[:-1])), schema)
    assert compiled


# (schema index in _WALKED, compact JSON text, whether exactly one branch / the schema
# accepts it): values in the overlap of two oneOf branches, in a `not`, beside an anyOf.
# Both backends write properties in the order the schema lists them.
_VERDICTS = [
    (0, '{"v":{"a":"s"}}', True), (0, '{"v":{"b":1,"a":1}}', True),
    (0, '{"v":{"a":"s","b":1}}', True), (0, '{"v":{"a":1}}', False),
    (1, "7", False), (1, "3", True), (1, "12", True),
    (2, '"a"', False), (2, '"c"', True), (2, "1", True), (2, '"abc"', False),
    (3, '{"name":"admin"}', False), (3, '{"name":"admins"}', True), (3, '{"name":"adm"}', True),
    (4, '{"kind":"a","x":1}', True), (4, '{"kind":"a","y":true}', False),
    (4, '{"kind":"b","y":true}', True),
    (5, '{"p":1}', True), (5, '{}', False), (5, '{"p":1,"q":"s"}', True),
    (7, '"a"', True), (7, '"a-b"', True), (7, '"-a"', False), (7, '"a-"', False),
    (8, '"a1"', True), (8, '"1a"', True), (8, '"aa"', False), (8, '"a1b2c"', False),
    (9, '{"..x":null}', False), (9, '{"./x":null}', True), (9, '{".":null}', True),
]


@pytest.mark.slow
def test_rewritten_schemas_compile_to_grammars_with_the_original_verdicts(
    backend: Any, guidance_backend: Any, tokenizer: Any
) -> None:
    from tests.v1.structured_output.conftest import EOS_IDS
    from vllm import StructuredOutputsParams

    checked = 0
    for index, text, ok in _VERDICTS:
        schema = _WALKED[index]
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) == ok, text
        params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        ids = tokenizer.encode(text, add_special_tokens=False) + [EOS_IDS[0]]
        for b in (backend, guidance_backend):
            try:
                grammar = b.compile_grammar(params)
            except UnsupportedConstraintError:
                continue
            assert grammar.accept_tokens("t", ids) == ok, (text, type(b).__name__)
            checked += 1
    assert checked >= len(_VERDICTS)


@pytest.mark.parametrize(
    "schema, fragment",
    [
        ({"allOf": None, "not": {}}, "at #: 'allOf' must be an array"),
        ({"properties": {"a": {"required": [[]]}}}, "at #/properties/a: 'required' must list"),
        ({"anyOf": [{"type": "string"}], "oneOf": {"type": "null"}}, "'oneOf' must be an array"),
    ],
)
def test_keywords_of_the_wrong_json_type_are_named(schema: dict[str, Any], fragment: str) -> None:
    with pytest.raises(GrammarCompileError) as info:
        normalize_json_schema(schema)
    assert fragment in info.value.message


def test_a_schema_seen_again_is_not_normalized_again(monkeypatch) -> None:
    """Remembered by text and options (the admission check and the backend both normalize a
    request's schema): equal results, each a copy a caller may edit, key order kept; a
    refusal is raised every time; a schema that is not plain JSON is normalized as it is."""
    from vllm.v1.structured_output.schema import normalize as module

    calls: list[Any] = []
    real = module._normalize
    monkeypatch.setattr(module, "_normalize", lambda *a: calls.append(a) or real(*a))
    schema = {"type": "object", "properties": {"zeta": {"type": "string"},
                                               "alpha": {"const": "remembered-7f3"}}}
    first = normalize_json_schema(schema)
    first["properties"]["zeta"]["type"] = "edited by a caller"
    second = normalize_json_schema(schema)
    assert len(calls) == 1 and second["properties"]["zeta"] == {"type": "string"}
    assert list(second["properties"]) == ["zeta", "alpha"]
    closed = normalize_json_schema(schema, disable_additional_properties=True)
    assert len(calls) == 2 and closed["additionalProperties"] is False
    refused = {"type": "integer", "minimum": 5, "maximum": 4, "title": "remembered-7f3"}
    for _ in range(2):
        with pytest.raises(GrammarCompileError):
            normalize_json_schema(refused)
    assert len(calls) == 4
    odd = {"type": "number", "maximum": float("nan")}  # not JSON: never remembered
    normalize_json_schema(odd)
    normalize_json_schema(odd)
    assert len(calls) == 6
