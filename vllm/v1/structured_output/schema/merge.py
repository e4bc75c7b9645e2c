"""Intersections of JSON schemas written as one schema (docs/architecture.md section 5).

`intersect(a, b)` is the schema of the values both match, when that can be written without
`allOf`: xgrammar refuses several `allOf` members and keywords beside `anyOf`, and llguidance
intersects recursive schemas until "Schema intersection stack level exceeded". The rewrites
built on it are exact:
- `merge_all_of`: the members of an `allOf` join their parent (their `if`/`then`/`else`
  are handed back, for the parent's rewrite of conditionals);
- `distribute_any_of`: keywords beside an `anyOf` (and several `anyOf` rules) are
  distributed into its branches, `A and anyOf [B, C]` = `anyOf [A and B, A and C]`, up to
  MAX_BRANCHES branches.

Pure Python.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
import threading
from typing import Any

from vllm.exceptions import GrammarCompileError
from vllm.v1.structured_output.schema.facts import (
    ANNOTATIONS,
    FIELD,
    TYPE_KINDS,
    canonical,
    is_number,
    kind_of,
    prune,
    resolve,
    type_names,
)

# The most branches distributing keywords into an `anyOf` may produce; past it the schema is
# left for llguidance, which intersects lazily.
MAX_BRANCHES = 32
# How deep intersections of subschemas may nest (recursive definitions stop here).
_MAX_DEPTH = 12

# Keywords whose meaning depends on where they stand or on their siblings' results: a schema
# holding one is not moved into another.
_SCOPED = frozenset({
    "unevaluatedProperties", "unevaluatedItems", "$id", "id", "$anchor", "$dynamicRef",
    "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor", "$defs", "definitions",
})
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_OBJECT_KEYS = ("properties", "patternProperties", "additionalProperties")
_ARRAY_KEYS = ("prefixItems", "items")
_CONDITION_KEYS = ("if", "then", "else")
_CONTAINS_KEYS = ("contains", "minContains", "maxContains")
_VALUE_KEYS = ("const", "enum")
# Asserted by one subschema each: two different ones cannot share a node.
_SINGLE = ("pattern", "format", "propertyNames", "dependentRequired", "dependentSchemas",
           "contentSchema")


class _Unwritable(Exception):
    """The intersection has no single-schema form here."""


class RecursiveIntersection(Exception):
    """Two references are intersected inside their own intersection: the result is an
    infinite schema (llguidance gives up with "Schema intersection stack level exceeded")."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__(first, second)
        self.refs = (first, second)


# The pairs of references being intersected by this thread's current `intersect` call.
_active = threading.local()


def intersect(a: Any, b: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """One schema matching exactly the values both `a` and `b` match; False when provably no
    value does; None when it cannot be written as one schema here. Neither input changes.
    Raises RecursiveIntersection when two references meet again inside their own
    intersection."""
    outermost = getattr(_active, "pairs", None) is None
    if outermost:
        _active.pairs = set()
    try:
        return _intersect(a, b, root, depth)
    except _Unwritable:
        return None
    finally:
        if outermost:
            _active.pairs = None


def _intersect(a: Any, b: Any, root: dict[str, Any], depth: int) -> Any:
    for x in (a, b):
        if not isinstance(x, (dict, bool)) or (isinstance(x, dict) and not _well_formed(x)):
            raise _Unwritable
    if depth > _MAX_DEPTH:
        raise _Unwritable
    if a is False or b is False:
        return False
    if a is True or a == {}:
        return copy.deepcopy(b)
    if b is True or b == {} or _same(a, b):
        return copy.deepcopy(a)
    if "$ref" not in a or "$ref" not in b:
        return _intersect_dicts(a, b, root, depth)
    pair = (json.dumps(a, sort_keys=True), json.dumps(b, sort_keys=True))
    if pair in _active.pairs:
        raise RecursiveIntersection(str(a["$ref"]), str(b["$ref"]))
    _active.pairs.add(pair)
    try:
        return _intersect_dicts(a, b, root, depth)
    finally:
        _active.pairs.discard(pair)


def _intersect_dicts(a: dict[str, Any], b: dict[str, Any], root: dict[str, Any], depth: int) -> Any:
    a, b = _inline(a, root, depth), _inline(b, root, depth)
    if a is False or b is False:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise _Unwritable
    if (_SCOPED & set(a)) or (_SCOPED & set(b)) or not (_well_formed(a) and _well_formed(b)):
        raise _Unwritable
    out: dict[str, Any] = {}
    keys = list(dict.fromkeys([*a, *b]))
    for key in keys:
        if key in ANNOTATIONS:
            out.setdefault(key, a.get(key, b.get(key)))
    _merge_types(a, b, out)
    _merge_bounds(a, b, out)
    _merge_values(a, b, out)
    for key in ("required",):
        if key in a or key in b:
            out[key] = list(dict.fromkeys([*a.get(key, []), *b.get(key, [])]))
    if "multipleOf" in a or "multipleOf" in b:
        out["multipleOf"] = _merge_multiple(a.get("multipleOf"), b.get("multipleOf"))
    if a.get("uniqueItems") is True or b.get("uniqueItems") is True:
        out["uniqueItems"] = True
    elif "uniqueItems" in a or "uniqueItems" in b:
        out["uniqueItems"] = False
    for key in _SINGLE:
        _merge_single(a, b, out, (key,))
    _merge_single(a, b, out, _CONTAINS_KEYS)
    _merge_single(a, b, out, _CONDITION_KEYS)
    _merge_objects(a, b, out, root, depth)
    _merge_arrays(a, b, out, root, depth)
    _merge_combinators(a, b, out)
    handled = {
        *ANNOTATIONS, "type", *_LOWER, *_UPPER, *_VALUE_KEYS, "required", "multipleOf",
        "uniqueItems", *_SINGLE, *_CONTAINS_KEYS, *_CONDITION_KEYS, *_OBJECT_KEYS,
        *_ARRAY_KEYS, "anyOf", "oneOf", "allOf", "not", "$ref",
    }
    for key in keys:
        if key not in handled:  # a vendor keyword (`x-...`, `discriminator`): annotations
            _merge_single(a, b, out, (key,))
    return prune(out, root)


# The JSON type each keyword's value must have for the merge rules to read it.
_SHAPES: dict[str, type | tuple[type, ...]] = {
    "required": list, "enum": list, "allOf": list, "anyOf": list, "oneOf": list,
    "prefixItems": list, "properties": dict, "patternProperties": dict,
    "type": (str, list),
}


def _well_formed(node: dict[str, Any]) -> bool:
    """False when a keyword has a value of the wrong JSON type (an invalid schema, left to
    the backends to refuse rather than merged into something else)."""
    if not all(isinstance(node[k], shape) for k, shape in _SHAPES.items() if k in node):
        return False
    return all(isinstance(n, str) for n in node.get("required", []))


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON (Python's == calls False and 0 equal)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _inline(node: Any, root: dict[str, Any], depth: int) -> Any:
    """`node` with its local `$ref` replaced by the schema it points to (and intersected with
    the keywords beside it, which apply too from 2019-09 on; earlier drafts' siblings were
    dropped before this runs)."""
    if not isinstance(node, dict) or not isinstance(node.get("$ref"), str):
        return node
    target = resolve({"$ref": node["$ref"]}, root)
    if isinstance(target, dict) and "$ref" in target:
        raise _Unwritable  # a remote or unresolvable ref
    rest = {k: v for k, v in node.items() if k != "$ref"}
    return _intersect(target, rest, root, depth + 1) if rest else target


def _type_set(node: dict[str, Any]) -> set[str] | None:
    declared = node.get("type")
    if declared is None:
        return None
    names = [declared] if isinstance(declared, str) else declared
    if not isinstance(names, list):
        raise _Unwritable
    return {k for t in names if isinstance(t, str) for k in TYPE_KINDS.get(t, ())}


def _merge_types(a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> None:
    ta, tb = _type_set(a), _type_set(b)
    if ta is None and tb is None:
        return
    found = (ta if ta is not None else tb) & (tb if tb is not None else ta)
    if "fraction" in found and "integer" not in found:
        raise _Unwritable
    names = type_names(found)
    out["type"] = names[0] if len(names) == 1 else names


def _merge_bounds(a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> None:
    for keys, pick in ((_LOWER, max), (_UPPER, min)):
        for key in keys:
            got = [x[key] for x in (a, b) if key in x]
            if not all(is_number(v) for v in got):
                raise _Unwritable
            if got:
                out[key] = pick(got)


def _merge_multiple(x: Any, y: Any) -> Any:
    if x is None or y is None or x == y:
        return y if x is None else x
    whole = all(isinstance(v, int) and not isinstance(v, bool) for v in (x, y))
    if not whole:
        raise _Unwritable
    return x * y // math.gcd(x, y)


def _listed(node: dict[str, Any]) -> list[Any] | None:
    """The values `node` lists (both `const` and `enum` when it has both), else None."""
    enum = node.get("enum") if isinstance(node.get("enum"), list) else None
    if "const" not in node:
        return enum
    if enum is not None and canonical(node["const"]) not in {canonical(v) for v in enum}:
        return []
    return [node["const"]]


def _merge_values(a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> None:
    la, lb = _listed(a), _listed(b)
    if la is None and lb is None:
        return
    if la is None or lb is None:
        kept = list(la if la is not None else lb)
    else:
        other = {canonical(v) for v in lb}
        kept = [v for v in la if canonical(v) in other]
    found = _type_set(out)
    if found is not None:
        kept = [v for v in kept if kind_of(v) in found]
    if len(kept) == 1:
        out["const"] = kept[0]
    else:
        out["enum"] = kept


def _merge_single(
    a: dict[str, Any], b: dict[str, Any], out: dict[str, Any], group: tuple[str, ...]
) -> None:
    """Keywords read together (`group`) come from one side; equal on both sides, once."""
    ga = {k: a[k] for k in group if k in a}
    gb = {k: b[k] for k in group if k in b}
    if ga and gb and not _same(ga, gb):
        raise _Unwritable
    out.update(copy.deepcopy(ga or gb))


def _pattern_hits(patterns: dict[str, Any], name: str) -> bool:
    for pattern in patterns:
        try:
            if re.search(pattern, name):
                return True
        except (re.error, RecursionError, OverflowError):
            raise _Unwritable from None
    return False


def _schema_for(node: dict[str, Any], name: str) -> Any:
    """What `node` asks of property `name` beyond its patternProperties."""
    listed = node.get("properties", {})
    if name in listed:
        return listed[name]
    if _pattern_hits(node.get("patternProperties", {}), name):
        return True
    return node.get("additionalProperties", True)


def _merge_objects(
    a: dict[str, Any], b: dict[str, Any], out: dict[str, Any], root: dict[str, Any], depth: int
) -> None:
    if not any(k in x for x in (a, b) for k in _OBJECT_KEYS):
        return
    for x in (a, b):
        for key in ("properties", "patternProperties"):
            if not isinstance(x.get(key, {}), dict):
                raise _Unwritable
    pat_a, pat_b = a.get("patternProperties", {}), b.get("patternProperties", {})
    extra_a, extra_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
    # A name only the other side's pattern matches would escape this side's
    # additionalProperties in the merged node.
    if (extra_a not in (True, {}) and set(pat_b) - set(pat_a)) or (
        extra_b not in (True, {}) and set(pat_a) - set(pat_b)
    ):
        raise _Unwritable
    names = list(dict.fromkeys([*a.get("properties", {}), *b.get("properties", {})]))
    if names:
        out["properties"] = {
            n: _need(_intersect(_schema_for(a, n), _schema_for(b, n), root, depth + 1))
            for n in names
        }
    patterns = {**pat_a}
    for p, sub in pat_b.items():
        patterns[p] = _need(_intersect(patterns[p], sub, root, depth + 1)) if p in patterns \
            else sub
    if patterns:
        out["patternProperties"] = copy.deepcopy(patterns)
    if "additionalProperties" in a or "additionalProperties" in b:
        out["additionalProperties"] = _need(_intersect(extra_a, extra_b, root, depth + 1))


def _merge_arrays(
    a: dict[str, Any], b: dict[str, Any], out: dict[str, Any], root: dict[str, Any], depth: int
) -> None:
    if not any(k in x for x in (a, b) for k in _ARRAY_KEYS):
        return
    pa, pb = a.get("prefixItems", []), b.get("prefixItems", [])
    if not isinstance(pa, list) or not isinstance(pb, list):
        raise _Unwritable
    ia, ib = a.get("items", True), b.get("items", True)
    if pa or pb:
        out["prefixItems"] = [
            _need(_intersect(pa[i] if i < len(pa) else ia, pb[i] if i < len(pb) else ib, root,
                             depth + 1))
            for i in range(max(len(pa), len(pb)))
        ]
    if "items" in a or "items" in b:
        out["items"] = _need(_intersect(ia, ib, root, depth + 1))


def _merge_combinators(a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> None:
    rules: list[Any] = [*copy.deepcopy(a.get("allOf", [])), *copy.deepcopy(b.get("allOf", []))]
    for key in ("anyOf", "oneOf"):
        got = [x[key] for x in (a, b) if key in x]
        if got:
            out[key] = copy.deepcopy(got[0])
            rules.extend({key: copy.deepcopy(g)} for g in got[1:])
    if "not" in a and "not" in b:
        out["not"] = {"anyOf": [copy.deepcopy(a["not"]), copy.deepcopy(b["not"])]}
    elif "not" in a or "not" in b:
        out["not"] = copy.deepcopy(a.get("not", b.get("not")))
    if "$ref" in a or "$ref" in b:
        raise _Unwritable  # left after inlining: a ref this module cannot follow
    if rules:
        out["allOf"] = rules


def _need(schema: Any) -> Any:
    """A subschema intersection's result (False is fine there: a property that may not
    appear, an item that may not exist)."""
    if schema is None:
        raise _Unwritable
    return schema


def pop_conditions(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Removes `if`/`then`/`else` from `node` and returns them ([] when absent)."""
    if "if" not in node and "then" not in node and "else" not in node:
        return []
    return [{k: node.pop(k) for k in _CONDITION_KEYS if k in node}]


def merge_all_of(
    node: dict[str, Any], root: dict[str, Any], path: str, conditions: bool = True
) -> list[dict[str, Any]]:
    """Merges, in place, the members of `node`'s `allOf` into `node` where `intersect` can;
    the others stay in `allOf`. With `conditions`, the conditionals (`if`/`then`/`else`) of
    `node` and of its merged members are removed and returned, for the caller to rewrite
    against the merged node (whose properties may list the values a condition tests); else
    they are merged like any keyword. Exact. Raises GrammarCompileError (naming `path`) when
    the members provably share no value."""
    members = node.get("allOf")
    if not isinstance(members, list) or not members or (_SCOPED - ANNOTATIONS) & set(node):
        return []
    found = pop_conditions(node) if conditions else []
    merged: Any = {k: v for k, v in node.items() if k != "allOf" and k not in ANNOTATIONS}
    kept: list[Any] = []
    for member in members:
        member = resolve(member, root)
        member = copy.deepcopy(member)
        inner = pop_conditions(member) if isinstance(member, dict) and conditions else []
        result = intersect(merged, member, root)
        if result is None:
            kept.append(member if not inner else {**member, **inner[0]})
            continue
        if result is False:
            raise GrammarCompileError(
                FIELD, f"at {path}: the members of 'allOf' have no value in common, so no "
                "value can match",
            )
        found.extend(inner)
        merged = {} if result is True else result
    for key in [k for k in node if k not in ANNOTATIONS]:
        del node[key]
    node.update(merged)
    kept = [*node.pop("allOf", []), *kept]
    if kept:
        node["allOf"] = kept
    return found


def distribute_any_of(node: dict[str, Any], root: dict[str, Any]) -> None:
    """Rewrites, in place, `node`'s keywords beside `anyOf` and its `allOf` members that are
    plain `anyOf` rules as one `anyOf` of merged branches (branches no value can match are
    left out). Left as it is when a branch cannot be merged, when other `allOf` members
    remain, or past MAX_BRANCHES branches. Exact."""
    groups: list[list[Any]] = []
    if isinstance(node.get("anyOf"), list):
        groups.append(node["anyOf"])
    members = node.get("allOf", [])
    if not isinstance(members, list):
        return
    for member in members:
        if not isinstance(member, dict) or set(member) - ANNOTATIONS != {"anyOf"}:
            return
        if not isinstance(member["anyOf"], list):
            return
        groups.append(member["anyOf"])
    rest = {k: v for k, v in node.items() if k not in ("anyOf", "allOf") and k not in ANNOTATIONS}
    if not groups or (not rest and len(groups) == 1):
        return
    if math.prod(len(g) for g in groups) > MAX_BRANCHES:
        return
    branches: list[Any] = []
    for combo in itertools.product(*groups):
        acc: Any = rest
        for choice in combo:
            acc = intersect(acc, choice, root)
            if acc is None:
                return
            if acc is False:
                break
        if acc is not False:
            branches.append(acc)
    for key in [*rest, "allOf"]:
        node.pop(key, None)
    node["anyOf"] = branches
