"""`oneOf` ("exactly one branch matches") as an `anyOf`, which every backend enforces
(docs/architecture.md section 5).

Two branches that provably share no value (kinds, listed values, a discriminator property,
closed objects with disjoint names, disjoint numeric or length ranges) stay as they are.
Two that may share values are made exclusive: each keeps only what the other refuses,
`oneOf [A, B]` = `anyOf [A and not B, B and not A]`, with `not B` written by `negate` and
merged into A by `intersect`. When a negation is not exact the branch is narrowed (never
admitting a value the `oneOf` refuses); when that leaves a branch no value at all, or more
than MAX_PIECES branches, the `oneOf` is refused naming the two branches.

Pure Python.
"""

from __future__ import annotations

import json
from typing import Any

from vllm.exceptions import UnsupportedConstraintError
from vllm.v1.structured_output.schema.facts import (
    ALL_KINDS,
    FIELD,
    decide,
    is_number,
    kinds,
    matches,
    resolve,
    values,
)
from vllm.v1.structured_output.schema.merge import intersect
from vllm.v1.structured_output.schema.negate import negate

# The most `anyOf` branches one `oneOf` may become (each overlap can split a branch).
MAX_PIECES = 64


def rewrite_one_of(node: dict[str, Any], root: dict[str, Any], path: str, coerce: bool) -> None:
    """Replaces, in place, `node["oneOf"]` by the equivalent (or, where a negation is not
    exact, narrower) `anyOf` of branches no two values share. With `coerce` (the server's
    `one_of_as_any_of`), branches that cannot be made exclusive become a plain `anyOf`.

    Raises UnsupportedConstraintError naming the two branches that cannot be made exclusive.
    """
    branches = node["oneOf"]
    outer = kinds({k: v for k, v in node.items() if k != "oneOf"}, root)
    outer_required = set(node["required"]) if isinstance(node.get("required"), list) else set()
    pieces, failure = _exclusive(branches, outer, outer_required, root, path, compact=False)
    if failure and failure[1]:
        # Too many alternatives: each branch keeps one way of refusing each other branch.
        pieces, failure = _exclusive(branches, outer, outer_required, root, path, compact=True)
    failure_text = failure[0] if failure else None
    if failure_text and not coerce:
        raise UnsupportedConstraintError(
            FIELD,
            failure_text + "; make the branches disjoint (different types, or a required property "
            "with a different 'const' in each), use 'anyOf', or start the server with "
            "--structured-outputs-config.one_of_as_any_of true",
        )
    result = list(branches) if failure_text else [p for group in pieces for p in group]
    del node["oneOf"]
    if "anyOf" in node:
        node.setdefault("allOf", []).append({"anyOf": result})
    else:
        node["anyOf"] = result


def _exclusive(
    branches: list[Any], outer: frozenset[str], outer_required: set[str],
    root: dict[str, Any], path: str, compact: bool,
) -> tuple[list[list[Any]], tuple[str, bool] | None]:
    """Each branch as pieces that no other branch matches, or (why not, whether it was the
    MAX_PIECES limit). `compact`: see `_exclude`."""
    pieces: list[list[Any]] = [[b] for b in branches]
    for i, a in enumerate(branches):
        for j in range(i + 1, len(branches)):
            if disjoint(a, branches[j], outer, outer_required, root):
                continue
            for x, y in ((i, j), (j, i)):
                had = bool(pieces[x])
                pieces[x], exact = _exclude(pieces[x], branches[y], outer, root, compact)
                if had and not pieces[x] and not exact:
                    return pieces, (
                        f"at {path}: 'oneOf' branches {path}/oneOf/{i} and {path}/oneOf/{j} "
                        "may overlap, and the values of one that the other refuses have no "
                        "schema here, so 'exactly one' cannot be enforced by any backend",
                        False,
                    )
            if sum(len(p) for p in pieces) > MAX_PIECES:
                return pieces, (
                    f"at {path}: making the 'oneOf' branches exclusive needs more than "
                    f"{MAX_PIECES} alternatives (branch {path}/oneOf/{i} overlaps "
                    f"{path}/oneOf/{j})",
                    True,
                )
    return pieces, None


def _exclude(
    pieces: list[Any], other: Any, outer: frozenset[str], root: dict[str, Any], compact: bool
) -> tuple[list[Any], bool]:
    """`pieces` narrowed to the values `other` refuses; whether that was exact. `compact`
    keeps one way of refusing `other` per piece (a missing property first): narrower, but
    the alternatives no longer multiply with each overlapping branch."""
    out: list[Any] = []
    exact = True
    for piece in pieces:
        listed = _unlisted(piece, other, root)
        if listed is not None:
            kept, ok = listed
            out.extend(kept)
            exact = exact and ok
            continue
        within = frozenset(outer & kinds(piece, root))
        names = tuple(_names(piece, root)) + tuple(_names(other, root))
        negations, ok = negate(other, root, within, names)
        exact = exact and ok
        if compact:
            negations.sort(key=lambda n: not _is_absence(n))
        for negation in negations:
            merged = intersect(piece, negation, root)
            if merged is None:
                out.append({"allOf": [piece, negation]})
            elif merged is not False:
                out.append(merged)
            else:
                continue
            if compact:
                exact = exact and len(negations) == 1
                break
    return out, exact


def _unlisted(piece: Any, other: Any, root: dict[str, Any]) -> tuple[list[Any], bool] | None:
    """For a piece that lists its values (const/enum): the piece keeping only the values
    `other` refuses, checked one by one with `jsonschema` ([] when none is left), and whether
    that was exact (not when a value's verdict is undecided or `other` has a `format`,
    which `jsonschema` does not check). None for any other piece."""
    listed = values(piece, root)
    schema = resolve(piece, root)
    if listed is None or not isinstance(schema, dict):
        return None
    kept: list[Any] = []
    exact = '"format"' not in json.dumps(other)
    for text in sorted(listed):
        value = json.loads(text)
        if decide(value, schema, root) is not True:
            continue  # not one of the piece's own values (`const` beside `enum`, a type)
        verdict = decide(value, other, root)
        exact = exact and verdict is not None
        if verdict is False:
            kept.append(value)
    if not kept:
        return [], exact
    narrowed = {k: v for k, v in schema.items() if k not in ("const", "enum")}
    if len(kept) == 1:
        narrowed["const"] = kept[0]
    else:
        narrowed["enum"] = kept
    return [narrowed], exact


def _is_absence(schema: Any) -> bool:
    """True for a negation piece that only says "this property is absent"."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    return isinstance(props, dict) and list(props.values()) == [False] and \
        set(schema) <= {"type", "properties"}


def _names(schema: Any, root: dict[str, Any]) -> list[str]:
    """Property names `schema` lists or requires."""
    schema = resolve(schema, root)
    if not isinstance(schema, dict):
        return []
    found = list(schema.get("properties", {})) if isinstance(schema.get("properties"), dict) \
        else []
    if isinstance(schema.get("required"), list):
        found += [n for n in schema["required"] if isinstance(n, str)]
    return list(dict.fromkeys(found))


def disjoint(
    a: Any, b: Any, outer: frozenset[str], outer_required: set[str], root: dict[str, Any],
    depth: int = 0,
) -> bool:
    """True when no value (of the kinds `outer` allows, and for objects with the
    `outer_required` names) can match both `a` and `b`."""
    shared = kinds(a, root) & kinds(b, root) & outer
    if not shared:
        return True
    va, vb = values(a, root), values(b, root)
    if va is not None and vb is not None and not va & vb:
        return True
    # A branch of listed values: none of them matches the other branch.
    for listed, other in ((va, b), (vb, a)):
        if listed is not None and not any(matches(json.loads(v), other, root) for v in listed):
            return True
    a, b = resolve(a, root), resolve(b, root)
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > 4:
        return False
    if shared <= {"integer", "fraction"} and _apart(_range(a), _range(b)):
        return True
    for kind, low, high in (("string", "minLength", "maxLength"),
                            ("array", "minItems", "maxItems")):
        if shared == {kind} and _apart(_counts(a, low, high), _counts(b, low, high)):
            return True
    if shared != {"object"}:
        return False
    return _objects_disjoint(a, b, outer_required, root, depth)


def _objects_disjoint(
    a: dict[str, Any], b: dict[str, Any], outer_required: set[str], root: dict[str, Any],
    depth: int,
) -> bool:
    props_a = a.get("properties") if isinstance(a.get("properties"), dict) else {}
    props_b = b.get("properties") if isinstance(b.get("properties"), dict) else {}
    required_a = set(a["required"]) if isinstance(a.get("required"), list) else set()
    required_b = set(b["required"]) if isinstance(b.get("required"), list) else set()
    # A property both require whose values cannot meet.
    for name in (required_a | outer_required) & (required_b | outer_required):
        if name in props_a and name in props_b and disjoint(
            props_a[name], props_b[name], ALL_KINDS, set(), root, depth + 1
        ):
            return True
    # A closed object cannot carry a name the other requires.
    for closed, props, other_required in ((a, props_a, required_b), (b, props_b, required_a)):
        if closed.get("additionalProperties") is False and not closed.get("patternProperties"):
            if (other_required | outer_required) - set(props):
                return True
    return False


def _range(node: dict[str, Any]) -> tuple[float, bool, float, bool]:
    """(low, low is exclusive, high, high is exclusive) of a number schema's bounds."""
    low, low_ex, high, high_ex = -float("inf"), False, float("inf"), False
    for key, exclusive in (("minimum", False), ("exclusiveMinimum", True)):
        v = node.get(key)
        if is_number(v) and (v > low or (v == low and exclusive)):
            low, low_ex = v, exclusive
    for key, exclusive in (("maximum", False), ("exclusiveMaximum", True)):
        v = node.get(key)
        if is_number(v) and (v < high or (v == high and exclusive)):
            high, high_ex = v, exclusive
    return low, low_ex, high, high_ex


def _counts(node: dict[str, Any], low: str, high: str) -> tuple[float, bool, float, bool]:
    lo, hi = node.get(low, 0), node.get(high, float("inf"))
    return (lo if is_number(lo) else 0), False, (hi if is_number(hi) else float("inf")), False


def _apart(x: tuple[float, bool, float, bool], y: tuple[float, bool, float, bool]) -> bool:
    """True when the two ranges share no number."""
    for first, second in ((x, y), (y, x)):
        high, high_ex = first[2], first[3]
        low, low_ex = second[0], second[1]
        if high < low or (high == low and (high_ex or low_ex)):
            return True
    return False
