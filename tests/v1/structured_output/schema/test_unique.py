"""Tests of `uniqueItems: true` written with enforceable keywords (schema_unique.py): checked
on probe values with `jsonschema` (never accepting an array the original refuses), and by
walks through both backends' grammars."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.exceptions import UnsupportedConstraintError
from vllm.v1.structured_output.schema.normalize import normalize_json_schema
from vllm.v1.structured_output.schema.unique import MAX_TUPLES, first_character_bins

from tests.v1.structured_output.schema_strategies import compare

_WORDS = ["", "a", "b", "ab", "zed", "Zed", "1", "~x", "é", "m", "n"]
_PROBES: list[Any] = [[], None, "a", [1, 1], [True, False], [False, True], [True, True]] + [
    list(p) for n in (1, 2, 3) for p in itertools.permutations(["a", "b", "ab", "zed", "1"], n)
] + [["a", "a"], ["x", "y", "x"], [1, 2], [2, 1], [1, 2, 3], [3, 2, 1]]
_SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("count", range(2, 9))
def test_first_character_bins_are_disjoint_and_ascending(count: int) -> None:
    bins = first_character_bins(count)
    assert len(bins) == count
    for c in map(chr, range(32, 127)):
        hits = [i for i, b in enumerate(bins) if re.match(b, c)]
        assert len(hits) == 1, (c, bins)
    for first, second in itertools.combinations(map(chr, range(32, 127)), 2):
        a = next(i for i, b in enumerate(bins) if re.match(b, first))
        b = next(i for i, b in enumerate(bins) if re.match(b, second))
        assert a <= b  # the bins follow the characters' order


@_SETTINGS
@given(
    st.sampled_from([{"type": "string"}, {"type": "string", "maxLength": 3},
                     {"enum": ["a", "b", "ab", 1]}, {"type": "boolean"},
                     {"enum": [1, 2, 3, 1.0]}, {"const": "a"}, {"type": "integer"}]),
    st.integers(0, 4), st.none() | st.integers(0, 4),
)
def test_unique_items_never_accepts_an_array_the_original_refuses(
    items: dict[str, Any], low: int, high: int | None
) -> None:
    schema: dict[str, Any] = {"type": "array", "items": items, "uniqueItems": True,
                              "minItems": low}
    if high is not None:
        schema["maxItems"] = high
    out = compare(schema, _PROBES + [[w] for w in _WORDS] + [_WORDS[:2], _WORDS[2:5]],
                  exact=False)
    if out is not None and items.get("type") == "string":
        assert "uniqueItems" not in json.dumps(out)  # strings are always told apart


def test_listed_values_become_ordered_tuples() -> None:
    out = normalize_json_schema({"type": "array", "items": {"enum": ["x", "y", "z"]},
                                 "uniqueItems": True, "minItems": 2})
    tuples = out["allOf"][0]["anyOf"] if "allOf" in out else out["anyOf"]
    # Two or three of the three values, in the list's order: 3 + 1 arrays.
    assert len(tuples) == 4
    assert [{"const": "x"}, {"const": "z"}] in [t["prefixItems"] for t in tuples]
    assert all(t["items"] is False for t in tuples)


def test_many_listed_values_keep_at_most_max_tuples() -> None:
    out = normalize_json_schema({"type": "array", "items": {"enum": list(range(20))},
                                 "uniqueItems": True, "minItems": 3})
    tuples = out["allOf"][0]["anyOf"] if "allOf" in out else out["anyOf"]
    assert len(tuples) == MAX_TUPLES


def test_unique_items_of_numbers_stay_refused_by_name() -> None:
    schema = {"type": "object", "properties": {"s": {"type": "array", "uniqueItems": True,
                                                     "items": {"type": "integer"},
                                                     "minItems": 2}}}
    assert normalize_json_schema(schema)["properties"]["s"]["uniqueItems"] is True


_WALKED = [
    {"type": "array", "items": {"type": "string"}, "minItems": 3, "uniqueItems": True},
    {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 2,
     "uniqueItems": True},
    {"type": "array", "items": {"enum": ["red", "green", "blue", "black"]}, "minItems": 2,
     "uniqueItems": True},
]


@pytest.mark.parametrize("schema", _WALKED, ids=["strings", "emails", "listed"])
def test_walks_through_unique_arrays_validate_with_both_backends(
    schema: dict[str, Any], backend: Any, guidance_backend: Any, tokenizer: Any,
    walk_vocab: Any,
) -> None:
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
                                          finish_after=20, max_steps=2000)
            assert stopped
            validate_json(json.loads(tokenizer.decode(tokens[:-1])), schema)
    assert compiled
