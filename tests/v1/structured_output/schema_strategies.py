"""Hypothesis strategies for small JSON schemas and the JSON values that tell them apart,
plus the probe oracle the schema-rewrite tests share: a rewritten schema must never accept a
value its original refuses, and must accept the same values where the rewrite is exact."""

from __future__ import annotations

from typing import Any

import jsonschema
from hypothesis import strategies as st

from vllm.exceptions import GrammarCompileError
from vllm.v1.structured_output.schema.normalize import normalize_json_schema

NAMES = ["a", "b", "c"]
WORDS = ["", "a", "ab", "admin", "b", "root"]
NUMBERS = [-1, 0, 1, 2, 2.5, 3, 10]
# The definitions every compared schema carries (a `$ref` may point at them).
DEFS = {"item": {"type": "object", "properties": {"a": {"type": "integer"}},
                 "required": ["a"]}}

scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(NUMBERS), st.sampled_from(WORDS),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(NAMES), inner, max_size=3),
    ),
    max_leaves=6,
)

_types = st.sampled_from(["null", "boolean", "integer", "number", "string", "object", "array"])


def _leaf(
    exact_only: bool, inner: st.SearchStrategy[dict[str, Any]] | None
) -> st.SearchStrategy[dict[str, Any]]:
    """One keyword (two for a closed object): the conjuncts schemas are made of; `inner`
    gives the schemas of properties and items (none without it)."""
    options = [
        _types.map(lambda t: {"type": t}),
        st.lists(_types, min_size=1, max_size=3, unique=True).map(lambda t: {"type": t}),
        scalars.map(lambda v: {"const": v}),
        st.lists(scalars, min_size=1, max_size=3).map(lambda v: {"enum": v}),
        st.sampled_from(NUMBERS).map(lambda n: {"minimum": n}),
        st.sampled_from(NUMBERS).map(lambda n: {"exclusiveMaximum": n}),
        st.integers(0, 3).map(lambda n: {"maxLength": n}),
        st.integers(0, 2).map(lambda n: {"minItems": n}),
        st.lists(st.sampled_from(NAMES), min_size=1, max_size=2, unique=True)
        .map(lambda r: {"required": r}),
    ]
    if inner is not None:
        options.append(st.tuples(st.sampled_from(NAMES), inner)
                       .map(lambda p: {"properties": {p[0]: p[1]}}))
    if not exact_only:
        options += [
            st.lists(st.sampled_from(NAMES), min_size=1, max_size=2, unique=True)
            .map(lambda n: {"properties": {k: {} for k in n}, "additionalProperties": False}),
            st.sampled_from(["^a", "b$"]).map(lambda p: {"type": "string", "pattern": p}),
            st.just({"dependentRequired": {"a": ["b"]}}),
            st.just({"$ref": "#/$defs/item"}),
            st.just({"uniqueItems": True}),
        ]
        if inner is not None:
            options += [
                inner.map(lambda s: {"items": s}),
                inner.map(lambda s: {"prefixItems": [s]}),
                inner.map(lambda s: {"patternProperties": {"^[ab]$": s}}),
            ]
    return st.one_of(options)


def _join(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part)  # a later keyword replaces an earlier one
    if "const" in out and "enum" in out:
        del out["enum"]  # read together they are one list; negate reads only `const`
    return out


def _flat(exact_only: bool) -> st.SearchStrategy[dict[str, Any]]:
    """A schema of one to three keywords, whose properties and items have their own."""
    bottom = st.lists(_leaf(exact_only, None), min_size=1, max_size=2).map(_join)
    return st.lists(_leaf(exact_only, bottom), min_size=1, max_size=3).map(_join)


def flat_schemas(exact_only: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """Schemas without combinators; with `exact_only`, only keywords whose refusals
    `negate` writes exactly."""
    return _flat(exact_only)


def combined_schemas(exact_only: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """A flat schema plus one combinator over flat schemas: oneOf, anyOf, allOf, not or
    if/then/else."""
    flat = _flat(exact_only)
    some = st.lists(flat, min_size=1, max_size=3)
    combinator = st.one_of(
        some.map(lambda b: {"oneOf": b}),
        some.map(lambda b: {"anyOf": b}),
        some.map(lambda b: {"allOf": b}),
        flat.map(lambda s: {"not": s}),
        st.tuples(flat, flat, flat).map(lambda c: {"if": c[0], "then": c[1], "else": c[2]}),
    )
    return st.tuples(st.one_of(st.just({}), flat), combinator).map(
        lambda p: {**p[0], **p[1]}
    )


def compare(schema: dict[str, Any], probes: list[Any], exact: bool) -> Any:
    """Normalizes `schema` and checks it on `probes` against the original (2020-12): never
    accepting a value the original refuses, and the same verdicts when `exact`. Returns the
    normalized schema, or None when it was refused."""
    schema = {**schema, "$defs": DEFS}
    try:
        out = normalize_json_schema(schema)
    except GrammarCompileError:
        return None
    original = jsonschema.Draft202012Validator(schema)
    rewritten = jsonschema.Draft202012Validator(out)
    for value in probes:
        got, want = rewritten.is_valid(value), original.is_valid(value)
        assert not got or want, (value, out)
        if exact:
            assert got == want, (value, out)
    return out
