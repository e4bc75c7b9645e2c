"""Tests of dropping definitions the root never references (schema_refs.py)."""

from __future__ import annotations

import pytest

from vllm.exceptions import UnsupportedConstraintError
from vllm.v1.structured_output.schema.normalize import normalize_json_schema
from vllm.v1.structured_output.schema.refs import drop_unreferenced_definitions

_OVERLAP = {"oneOf": [{"type": "string"}, {"type": "string", "pattern": "^a"}]}


def test_an_unreferenced_definition_causes_no_refusal() -> None:
    schema = {"definitions": {"unused": _OVERLAP, "used": {"type": "string"}},
              "$defs": {"alsoUnused": _OVERLAP},
              "type": "object", "properties": {"a": {"$ref": "#/definitions/used"}}}
    out = normalize_json_schema(schema)
    assert out["definitions"] == {"used": {"type": "string"}} and "$defs" not in out
    referenced = {**schema, "properties": {"a": {"$ref": "#/$defs/alsoUnused"}}}
    with pytest.raises(UnsupportedConstraintError, match=r"#/\$defs/alsoUnused"):
        normalize_json_schema(referenced)


def test_definitions_reached_through_other_definitions_stay() -> None:
    schema = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"items": {"$ref": "#/$defs/c"}},
                        "c": {"type": "integer"}, "d": {}},
              "$ref": "#/$defs/a"}
    drop_unreferenced_definitions(schema)
    assert set(schema["$defs"]) == {"a", "b", "c"}


@pytest.mark.parametrize("ref", ["#anchor", "other.json#/$defs/a", "#/$defs/a"])
def test_refs_this_cannot_follow_keep_every_definition(ref: str) -> None:
    schema = {"$defs": {"a": {"$anchor": "anchor"}, "b": {}},
              "properties": {"x": {"$ref": ref}}}
    drop_unreferenced_definitions(schema)
    kept = {"a"} if ref == "#/$defs/a" else {"a", "b"}
    assert set(schema["$defs"]) == kept
