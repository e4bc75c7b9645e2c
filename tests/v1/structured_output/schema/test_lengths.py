"""Tests of length bounds folded into a string's pattern or format for xgrammar
(schema_lengths.py): a folded pattern never matches a string the original pattern and
bounds refuse, and matches the same strings where the fold is exact; walks through
xgrammar's grammar validate against the original schema."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.v1.structured_output.schema.lengths import (
    MAX_FOLDED_COUNT,
    bounded_pattern,
    fold_lengths,
    spell_formats,
)

_SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))
# Patterns of one-character atoms (one variable count: exact) and others (several).
_EXACT = [r"^[a-z]+$", r"^[a-z][a-z0-9-]*$", r"^[^<>:\"|?*]+$", r"^a\d{2,}$", r"^x?$",
          r"^[ab]{2,6}$", r"^.\.[0-9]*$"]
_SEVERAL = [r"^[a-z]+-[0-9]+$", r"^a*b*c?$", r"^[ab]{1,3}[0-9]{2,}$"]
_ALPHABET = "ab-0.9x<\"z\n"


def _original(pattern: str, low: int, high: int | None, text: str) -> bool:
    # The backends' `$` is the end of the string: read the original the same way.
    return bool(re.fullmatch(pattern[1:-1], text)) and low <= len(text) and (
        high is None or len(text) <= high)


@_SETTINGS
@given(st.sampled_from(_EXACT + _SEVERAL), st.integers(0, 5), st.none() | st.integers(0, 8),
       st.lists(st.text(_ALPHABET, max_size=9), min_size=20, max_size=20))
def test_folded_patterns_never_widen_and_are_exact_with_one_count(
    pattern: str, low: int, high: int | None, texts: list[str]
) -> None:
    folded = bounded_pattern(pattern, low, high)
    if folded is None:
        return
    exact = pattern in _EXACT
    for text in texts + ["a" * n for n in range(9)]:
        got, want = bool(re.fullmatch(folded[1:-1], text)), _original(pattern, low, high, text)
        assert not got or want, (folded, text)
        if exact:
            assert got == want, (folded, text)


def test_large_bounds_are_capped() -> None:
    assert bounded_pattern(r"^[^<>]+$", 0, 4096) == "^[^<>]{1,%d}$" % MAX_FOLDED_COUNT
    assert bounded_pattern(r"^[a-z]+$", 1000, None) is None


@pytest.mark.parametrize("pattern", [r"^(ab)+$", r"^a|b$", r"[a-z]+", r"^a+?$", r"^\1$",
                                     r"^[[:alpha:]]+$", r"^a\b$"])
def test_other_shapes_are_not_folded(pattern: str) -> None:
    assert bounded_pattern(pattern, 1, 3) is None


@pytest.mark.parametrize("node, want", [
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, {"pattern": "^[a-z]{1,3}$"}),
    ({"type": "string", "format": "email", "minLength": 1}, {"format": "email"}),
    ({"type": "string", "format": "uuid", "minLength": 36, "maxLength": 40},
     {"format": "uuid"}),
    ({"type": "string", "format": "hostname", "maxLength": 255},
     {"pattern": "^[a-z0-9]{1,63}$"}),
    # Left for the check to refuse: an email may be longer than 9 characters.
    ({"type": "string", "format": "email", "maxLength": 9},
     {"format": "email", "maxLength": 9}),
    ({"type": "string", "format": "uri-reference", "minLength": 1},
     {"pattern": "^[A-Za-z0-9._~!$&'*+,;=/()-]{1,}$"}),
])
def test_formats_drop_or_fold_their_bounds(node: dict[str, Any], want: dict[str, Any]) -> None:
    fold_lengths(node)
    assert node == {"type": "string", **want}


_WALKED = [
    {"type": "string", "pattern": r"^[^<>:\"|?*]+$", "maxLength": 6},
    {"type": "string", "pattern": r"^[a-z][a-z0-9-]*$", "minLength": 3, "maxLength": 5},
    {"type": "object", "properties": {"s": {"type": "string", "format": "uri-reference",
                                            "minLength": 2, "maxLength": 8}},
     "required": ["s"]},
]


@pytest.mark.parametrize("schema", _WALKED, ids=["negated_class", "label", "uri_reference"])
def test_walks_through_folded_schemas_validate(
    schema: dict[str, Any], backend: Any, tokenizer: Any, walk_vocab: Any
) -> None:
    from tests.v1.structured_output.oracle import validate_json
    from tests.v1.structured_output.walker import random_walk
    from vllm import StructuredOutputsParams

    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    for seed in range(8):
        grammar = backend.compile_grammar(params)
        tokens, stopped = random_walk(grammar, walk_vocab, np.random.default_rng(seed),
                                      finish_after=6)
        assert stopped
        validate_json(json.loads(tokenizer.decode(tokens[:-1])), schema)


def test_formats_llguidance_lacks_become_class_patterns() -> None:
    schema = {"type": "object", "properties": {
        "r": {"type": "string", "format": "uri-reference", "maxLength": 9},
        "t": {"type": "string", "format": "uri-template"},
        "p": {"type": "string", "format": "uri-reference", "pattern": "^/"},
        "d": {"type": "string", "format": "date"}}}
    spell_formats(schema, frozenset({"uri-reference", "uri-template"}))
    props = schema["properties"]
    assert props["r"] == {"type": "string", "pattern": "^[A-Za-z0-9._~!$&'*+,;=/()-]*$",
                          "maxLength": 9}
    assert "format" not in props["t"] and re.fullmatch(props["t"]["pattern"][1:-1], "/a/{b}") \
        is None
    assert props["p"]["format"] == "uri-reference"  # a pattern beside it: left as it is
    assert props["d"] == {"type": "string", "format": "date"}


def test_guidance_takes_uri_reference_as_a_pattern(
    guidance_backend: Any, tokenizer: Any
) -> None:
    from vllm import StructuredOutputsParams

    schema = {"type": "string", "format": "uri-reference", "minLength": 1}
    for text, ok in [('"a/b.c"', True), ('"../x?y"', False), ('"a b"', False), ('""', False)]:
        grammar = guidance_backend.compile_grammar(StructuredOutputsParams(json=schema))
        ids = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
        assert grammar.accept_tokens("t", ids + [guidance_backend.stop_token_ids[0]]) == ok, text
