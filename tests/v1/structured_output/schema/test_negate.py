"""Tests of negations written without `not` (schema_negate.py) and of the `not` rewrite."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.v1.structured_output.schema.normalize import check_xgrammar_support, normalize_json_schema
from vllm.v1.structured_output.schema.negate import negate, not_one_of

from tests.v1.structured_output.schema_strategies import DEFS, compare, flat_schemas, json_values
from .test_one_of import PROBES

_SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))


@_SETTINGS
@given(flat_schemas(), st.lists(json_values, max_size=8))
def test_pieces_match_only_refused_values_and_all_of_them_when_exact(
    schema: dict[str, Any], extra: list[Any]
) -> None:
    root = {"$defs": DEFS}
    pieces, exact = negate(schema, root)
    original = jsonschema.Draft202012Validator({**schema, **root})
    validators = [jsonschema.Draft202012Validator({**p, **root}) for p in pieces]
    for value in PROBES + extra:
        refused = not original.is_valid(value)
        matched = any(v.is_valid(value) for v in validators)
        assert refused or not matched, (value, pieces)
        if exact:
            assert matched == refused, (value, pieces)


@pytest.mark.parametrize("words", [["admin", "root", "ad"], [""], ["a", "ab", "b-c", "é"]])
def test_not_one_of_matches_every_other_string(words: list[str]) -> None:
    pattern = not_one_of(words)
    candidates = ["", "a", "ab", "abc", "ad", "adm", "admin", "admins", "root", "roo", "b-c",
                  "b-", "é", "e", "x", "\n", "admin\n"]
    for text in candidates + words:
        assert bool(re.search(pattern, text)) == (text not in words), text


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "not": {"enum": ["admin", "root"]}},
        {"not": {"type": ["string", "null"]}},
        {"not": {"const": 2}},
        {"type": "object", "not": {"required": ["a", "b"]}},
        {"not": {"type": "object", "required": ["a"], "properties": {"a": {"const": 0}}}},
        {"type": "integer", "not": {"minimum": 1, "maximum": 2}},
    ],
    ids=["enum_of_strings", "types", "const_number", "required", "object", "range"],
)
def test_not_of_simple_schemas_is_written_out_exactly(schema: dict[str, Any]) -> None:
    probes = PROBES + ["admin", "root", "admins", {"a": 0, "b": 1}, {"a": 1}, 1.5, 2.0]
    out = compare(schema, probes, exact=True)
    assert "not" not in str(out)


def test_a_not_enum_of_strings_beside_nothing_else_goes_to_xgrammar() -> None:
    out = normalize_json_schema({"type": "string", "not": {"const": "x"}})
    check_xgrammar_support(out)


def test_not_of_what_has_no_schema_stays() -> None:
    # "a string not matching ^a" has no schema without `not`.
    schema = {"type": "string", "not": {"pattern": "^a"}}
    assert normalize_json_schema(schema)["not"] == {"pattern": "^a"}


def test_none_of_too_many_words_is_a_limit() -> None:
    from vllm.v1.structured_output.schema.negate import MAX_WORD_CHARACTERS

    words = [f"w{i:05d}" for i in range(MAX_WORD_CHARACTERS // 6 + 1)]
    assert not_one_of(words) is None
    assert not_one_of(words[:10]) is not None
    schema = {"type": "string", "not": {"enum": words}}
    assert normalize_json_schema(schema)["not"] == {"enum": words}  # left for the backends
