"""Negations of JSON schemas written without `not` (docs/architecture.md section 5), which no
backend enforces.

A schema is the conjunction of its keywords, so the values it refuses are the union, over
its keywords, of the values each keyword refuses: `not {type: string, maxLength: 3}` is
"not a string, or a string of 4 or more characters". `negate` writes that union for the
keywords whose refusals have a schema (a type, listed values, bounds, required names,
property and item schemas, recursively) and says whether it wrote all of them; leaving a
keyword out
only narrows the union, so the pieces never match a value the schema accepts.

Pure Python.
"""

from __future__ import annotations

import json
from typing import Any

from vllm.v1.structured_output.schema.facts import (
    ALL_KINDS,
    ANNOTATIONS,
    TYPE_KINDS,
    canonical,
    fraction_schema,
    kind_of,
    kinds_schema,
    prune,
    resolve,
    type_names,
)

# The most characters of listed strings written as one "none of these" regex.
MAX_WORD_CHARACTERS = 4096
# How deep property schemas are negated (a property of a property of ...).
_MAX_DEPTH = 4
# Keywords that only shape other keywords: they refuse nothing on their own here.
_INERT = frozenset({"minContains", "maxContains", "then", "else"})

# (keyword, kind it bounds, keyword of the opposite bound, offset): "minLength n" is refused
# by strings of at most n - 1 characters.
_COUNTS = (
    ("minLength", "string", "maxLength", -1), ("maxLength", "string", "minLength", 1),
    ("minItems", "array", "maxItems", -1), ("maxItems", "array", "minItems", 1),
    ("minProperties", "object", "maxProperties", -1),
    ("maxProperties", "object", "minProperties", 1),
)
_NUMERIC = {
    "minimum": "exclusiveMaximum", "exclusiveMinimum": "maximum",
    "maximum": "exclusiveMinimum", "exclusiveMaximum": "minimum",
}


def negate(
    schema: Any,
    root: dict[str, Any],
    within: frozenset[str] = ALL_KINDS,
    names: tuple[str, ...] = (),
    depth: int = 0,
) -> tuple[list[Any], bool]:
    """Schemas ("pieces") each matching only values `schema` refuses, and whether their
    union holds every refused value of the kinds `within` (exact). `names` are property names an
    object may carry besides those `schema` lists (used to negate `additionalProperties`).
    Pieces no value can match are left out."""
    if "fraction" in within:
        # Pieces are written with `type` names, and "number" covers both: the caller
        # intersects them with a schema of the kinds `within`, so covering integers too
        # changes nothing (and spares `fraction_schema`, which not every backend takes).
        within = within | {"integer"}
    schema = resolve(schema, root)
    if schema is True or schema == {}:
        return [], True
    if schema is False:
        return ([kinds_schema(within)] if type_names(within) else []), \
            not ("fraction" in within and "integer" not in within)
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return [], False
    pieces: list[Any] = []
    exact = True
    number = "number" if "fraction" in within else "integer" if "integer" in within else None
    for key, value in schema.items():
        if key in ANNOTATIONS or key in _INERT:
            continue
        got: list[Any] = []
        ok = True
        if key == "type":
            got, ok = _negate_type(value, within)
        elif key in ("const", "enum"):
            listed = [value] if key == "const" else value
            if not isinstance(listed, list) or ("const" in schema and key == "enum"):
                ok = False
            else:
                got, ok = _negate_values(listed, within)
        elif key in _NUMERIC:
            ok = _is_bound(value)
            if number is not None and ok:
                got = [{"type": number, _NUMERIC[key]: value}]
        elif key in {k for k, *_ in _COUNTS}:
            got, ok = _negate_count(key, value, within)
        elif key == "required":
            ok = isinstance(value, list) and all(isinstance(n, str) for n in value)
            if ok and "object" in within:
                got = [{"type": "object", "properties": {n: False}} for n in value]
        elif key == "properties" and isinstance(value, dict):
            if "object" in within:
                got, ok = _negate_properties(value, root, depth)
        elif key == "items" and "prefixItems" not in schema:
            if "array" in within:
                got, ok = _negate_items(value, root, depth)
        elif key == "prefixItems" and isinstance(value, list):
            if "array" in within:
                got, ok = _negate_prefix(value, root, depth)
        elif key == "additionalProperties":
            got, ok = _negate_extra(schema, value, root, within, names, depth)
        elif key == "patternProperties" and schema.get("additionalProperties") is None:
            ok = False
        else:
            ok = False  # no schema for this keyword's refusals here
        pieces.extend(got)
        exact = exact and ok
    kept = [prune(p, root) for p in pieces]
    return [p for p in kept if p is not False], exact


def _is_bound(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _negate_type(value: Any, within: frozenset[str]) -> tuple[list[Any], bool]:
    declared = [value] if isinstance(value, str) else value
    if not isinstance(declared, list):
        return [], False
    allowed = {k for t in declared if isinstance(t, str) for k in TYPE_KINDS.get(t, ())}
    rest = set(within) - allowed
    pieces = [kinds_schema(rest)] if type_names(rest) else []
    if "fraction" in rest and "integer" not in rest:
        pieces.append(fraction_schema())  # "numbers but not integers"
    return pieces, True


def _negate_values(listed: list[Any], within: frozenset[str]) -> tuple[list[Any], bool]:
    """Pieces for "none of `listed`": per kind, the kind's values other than those."""
    pieces: list[Any] = []
    exact = True
    by_kind: dict[str, list[Any]] = {}
    for v in listed:
        by_kind.setdefault(kind_of(v), []).append(v)
    if "null" in within and "null" not in by_kind:
        pieces.append({"type": "null"})
    if "boolean" in within:
        rest = [b for b in (True, False) if b not in by_kind.get("boolean", [])]
        if rest:
            pieces.append({"type": "boolean"} if len(rest) == 2 else {"const": rest[0]})
    if "string" in within:
        words = by_kind.get("string", [])
        if not words:
            pieces.append({"type": "string"})
        else:
            pattern = not_one_of(words)
            if pattern is None:
                exact = False
            else:
                pieces.append({"type": "string", "pattern": pattern})
    for kind in ("object", "array"):
        if kind in within:
            if kind in by_kind:
                exact = False  # "any object but these" has no schema
            else:
                pieces.append({"type": kind})
    numbers = sorted({json.loads(canonical(v)) for k in ("integer", "fraction")
                      for v in by_kind.get(k, [])})
    if "integer" in within:
        kind = "number" if "fraction" in within else "integer"
        if not numbers:
            pieces.append({"type": kind})
        else:
            # The open intervals around the listed numbers cover every other number.
            pieces.append({"type": kind, "exclusiveMaximum": numbers[0]})
            pieces.extend({"type": kind, "exclusiveMinimum": lo, "exclusiveMaximum": hi}
                          for lo, hi in zip(numbers, numbers[1:]))
            pieces.append({"type": kind, "exclusiveMinimum": numbers[-1]})
    elif "fraction" in within:
        exact = False
    return pieces, exact


def _negate_count(key: str, value: Any, within: frozenset[str]) -> tuple[list[Any], bool]:
    for name, kind, opposite, offset in _COUNTS:
        if name != key:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            return [], False
        if kind not in within or value + offset < 0:
            return [], True
        return [{"type": kind, opposite: value + offset}], True
    return [], False


def _negate_properties(
    props: dict[str, Any], root: dict[str, Any], depth: int
) -> tuple[list[Any], bool]:
    """Objects carrying a listed property with a value its schema refuses."""
    pieces: list[Any] = []
    exact = True
    for name, sub in props.items():
        got, ok = negate(sub, root, ALL_KINDS, (), depth + 1)
        exact = exact and ok
        pieces.extend({"type": "object", "required": [name], "properties": {name: p}}
                      for p in got)
    return pieces, exact


def _negate_items(items: Any, root: dict[str, Any], depth: int) -> tuple[list[Any], bool]:
    """Arrays holding an item that `items` refuses (`contains`, which the rewrites narrow
    to a leading item later)."""
    got, ok = negate(items, root, ALL_KINDS, (), depth + 1)
    return [{"type": "array", "contains": p} for p in got], ok


def _negate_prefix(
    prefix: list[Any], root: dict[str, Any], depth: int
) -> tuple[list[Any], bool]:
    """Arrays whose item at some listed position is refused by that position's schema."""
    pieces: list[Any] = []
    exact = True
    for i, sub in enumerate(prefix):
        got, ok = negate(sub, root, ALL_KINDS, (), depth + 1)
        exact = exact and ok
        pieces.extend({"type": "array", "minItems": i + 1, "prefixItems": [{}] * i + [p]}
                      for p in got)
    return pieces, exact


def _negate_extra(
    schema: dict[str, Any], extra: Any, root: dict[str, Any], within: frozenset[str],
    names: tuple[str, ...], depth: int,
) -> tuple[list[Any], bool]:
    """Objects carrying one of `names` that `schema` does not list, with a value its
    `additionalProperties` refuses: never exact ("some other name" has no schema)."""
    if "object" not in within or schema.get("patternProperties"):
        return [], False
    listed = schema.get("properties", {}) if isinstance(schema.get("properties"), dict) else {}
    pieces: list[Any] = []
    for name in names:
        if name in listed:
            continue
        got, _ = negate(extra, root, ALL_KINDS, (), depth + 1)
        pieces.extend({"type": "object", "required": [name], "properties": {name: p}}
                      for p in got)
    return pieces, extra is True or extra == {}


def not_one_of(words: list[str]) -> str | None:
    """An anchored regex matching exactly the strings not in `words` (None when a character
    cannot be written as a `\\uXXXX` escape, or when the words hold more than
    MAX_WORD_CHARACTERS characters: the regex grows with them). Written without optional
    groups (xgrammar 0.2.9 matches an optional group holding a repeat wrongly)."""
    if sum(len(w) for w in words) > MAX_WORD_CHARACTERS:
        return None
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    try:
        body = "^(?:" + "|".join(_not_in(trie)) + ")$"
    except ValueError:
        return None
    return body if "" in trie else body + "|^$"


def _char(ch: str) -> str:
    if ch.isascii() and ch.isalnum():
        return ch
    if ord(ch) > 0xFFFF:
        raise ValueError(ch)
    return f"\\u{ord(ch):04x}"


def _not_in(trie: dict[str, Any]) -> list[str]:
    """The non-empty suffixes that do not complete a word of `trie` (the words' end marked
    by ""), as alternatives."""
    children = sorted(c for c in trie if c)
    if not children:
        return ["[\\s\\S]+"]
    ways = ["[^" + "".join(_char(c) for c in children) + "][\\s\\S]*"]
    for c in children:
        below = trie[c]
        if "" not in below:
            ways.append(_char(c))  # the prefix itself is no word
        ways.append(_char(c) + "(?:" + "|".join(_not_in(below)) + ")")
    return ways
