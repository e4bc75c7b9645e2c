"""The keyword subsets of the compatibility backends, checked before they compile."""

from __future__ import annotations

import pytest

from vllm.exceptions import UnsupportedConstraintError
from vllm.v1.structured_output.schema.subset import SchemaSubset, check_subset, is_narrow

SUBSET = SchemaSubset("lib", frozenset({"type", "properties", "required", "items", "pattern",
                                        "maxItems", "prefixItems", "minItems", "enum", "const",
                                        "format", "maxLength", "anyOf", "allOf"}),
                      frozenset({"date"}), raw_patterns=True, plain_string_literals=True,
                      bare_type_lists=True)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z0-9]+$"}},
     "required": ["a"], "title": "annotations pass"},
    {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 1},
    {"anyOf": [{"enum": ["x", "y"]}, {"const": "z"}], "allOf": [{"type": "string"}]},
    {"type": "string", "format": "date"},
    {"type": ["string", "null"]},
])
def test_accepted(schema: dict) -> None:
    check_subset(schema, SUBSET)


@pytest.mark.parametrize("schema,fragment", [
    ({"type": "integer", "minimum": 1}, "'minimum'"),
    ({"type": "object", "properties": {"a": {"items": {"multipleOf": 2}}}}, "'multipleOf'"),
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "'allOf' with several"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "'a'"),
    ({"type": "array", "prefixItems": [{}], "minItems": 2}, "'prefixItems'"),
    ({"type": "string", "format": "email"}, "'email'"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'minLength'/'maxLength'"),
    ({"type": "string", "pattern": '^[^"]+$'}, "pattern"),
    ({"type": "string", "pattern": "^a.b$"}, "pattern"),
    ({"type": "string", "pattern": "^[ -~]+$"}, "pattern"),  # holds '"' and '\\'
    ({"enum": ["a", 1]}, "'enum'/'const'"),
    ({"const": "a\nb"}, "'enum'/'const'"),
    ({"type": ["string", "null"], "maxLength": 3}, "list of types"),
])
def test_refused_naming_the_keyword_and_backend(schema: dict, fragment: str) -> None:
    with pytest.raises(UnsupportedConstraintError) as info:
        check_subset(schema, SUBSET)
    assert info.value.param == "structured_outputs.json"
    assert fragment in info.value.message and "(unsupported by lib)" in info.value.message


def test_is_narrow() -> None:
    assert is_narrow(r"^[a-z]{2,4}-\d+(x|y)?$")
    assert is_narrow("[α-ω]+")
    for wide in (".", "[^a]", r"\S", r"\W+", r"\D", "[\u0000-\uffff]", "(?=a)a", "a(b"):
        assert not is_narrow(wide), wide
    assert not is_narrow("[a-z]", max_class=10)
