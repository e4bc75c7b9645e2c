"""What a JSON schema allows, read without compiling it: the kinds of value it may match,
the values it lists, whether a value matches it, whether no value can (docs/architecture.md
section 5). Every answer errs on the safe side for the rewrites that use it: "all kinds" and
"may match" when unsure.

Pure Python; `jsonschema` is imported only by `matches`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from vllm.exceptions import GrammarCompileError

FIELD = "structured_outputs.json"

# Keywords that assert nothing: they may sit beside anything without changing its meaning.
ANNOTATIONS = frozenset({
    "$schema", "$id", "id", "$anchor", "$comment", "$defs", "definitions", "$vocabulary",
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
    "contentMediaType", "contentEncoding",
})

# JSON values by kind; "integer" and "fraction" together are JSON Schema's "number".
ALL_KINDS = frozenset({"null", "boolean", "object", "array", "string", "integer", "fraction"})
TYPE_NAMES = frozenset({"null", "boolean", "object", "array", "string", "number"})
TYPE_KINDS = {
    "null": {"null"}, "boolean": {"boolean"}, "object": {"object"}, "array": {"array"},
    "string": {"string"}, "integer": {"integer"}, "number": {"integer", "fraction"},
}


# Where subschemas sit: maps of them, lists of them, single ones.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_SINGLES = (
    "additionalProperties", "items", "additionalItems", "propertyNames", "not", "if", "then",
    "else", "contains", "unevaluatedItems", "unevaluatedProperties",
)


def subschemas(node: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    """Every direct subschema of `node` with its location."""
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield sub, f"{path}/{key}/{name}"
    for key in SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield sub, f"{path}/{key}/{i}"
    for key in SCHEMA_SINGLES:
        if isinstance(node.get(key), dict):
            yield node[key], f"{path}/{key}"


def is_negated(node: dict[str, Any], sub: Any) -> bool:
    """True when `sub` is the `not` or the `if` of `node`: a subschema whose refusals the
    schema accepts, where the stricter rewrites would widen the schema, so they stay out.
    (By identity: a property may be named "not".)"""
    return sub is node.get("not") or sub is node.get("if")


def type_names(found: set[str] | frozenset[str]) -> list[str]:
    """The `type` names covering the kinds `found` ("fraction" counts only beside
    "integer": no type name means "numbers that are not integers")."""
    names = [t for t in ("null", "boolean", "object", "array", "string") if t in found]
    if "fraction" in found and "integer" in found:
        names.append("number")
    elif "integer" in found:
        names.append("integer")
    return names


def fraction_schema() -> dict[str, Any]:
    """A new schema of the numbers that are not integers (the kind "fraction"): no `type`
    says it, so it is written with `not`; the xgrammar backend enforces this one shape
    (schema_xgrammar.py), llguidance refuses it."""
    return {"type": "number", "not": {"type": "integer"}}


def is_fraction_schema(node: Any) -> bool:
    """True for `fraction_schema()`, with annotations or numeric bounds beside it."""
    if not isinstance(node, dict) or node.get("type") != "number":
        return False
    negated = node.get("not")
    if not isinstance(negated, dict) or {k: v for k, v in negated.items()
                                          if k not in ANNOTATIONS} != {"type": "integer"}:
        return False
    bounds = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
    return {k for k in node if k not in ANNOTATIONS} <= {"type", "not"} | bounds


def drop_fraction_branches(schema: Any, path: str = "#") -> str | None:
    """Removes, in place, the `anyOf` branches that hold a schema of numbers that are not
    integers (`fraction_schema`, which a backend may not write), where another branch
    remains: narrower, never wrong. Returns the location of a fraction schema that stays
    (a sole branch, or outside any `anyOf`), else None. Leaves `not` and `if` alone, where
    narrowing would widen the schema."""
    if not isinstance(schema, dict):
        return None
    if is_fraction_schema(schema):
        return path
    found: str | None = None
    done: set[int] = set()
    branches = schema.get("anyOf")
    if isinstance(branches, list) and len(branches) > 1:
        stays = [drop_fraction_branches(b, f"{path}/anyOf/{i}") for i, b in enumerate(branches)]
        kept = [b for b, where in zip(branches, stays) if where is None]
        if kept:
            schema["anyOf"] = kept
        else:
            found = stays[0]
        done = {id(b) for b in branches}
    for sub, sub_path in subschemas(schema, path):
        if id(sub) not in done and not is_negated(schema, sub):
            where = drop_fraction_branches(sub, sub_path)
            found = found or where
    return found


def kinds_schema(found: set[str] | frozenset[str]) -> dict[str, Any]:
    """A schema of every value of the kinds `found` (see `type_names`)."""
    names = type_names(found)
    return {"type": names[0] if len(names) == 1 else names}


def kind_of(value: Any) -> str:
    """The kind (see ALL_KINDS) of the JSON value `value`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "fraction"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def canonical(value: Any) -> str:
    """JSON text equal for values JSON Schema treats as equal (1 and 1.0 included)."""
    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(value), sort_keys=True)


def resolve(node: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """`node` with a local `$ref` (`#/...`) followed, else `node` itself (also when the ref
    cannot be followed here: the analysis then knows less, never something wrong)."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and depth < 16:
        ref = node["$ref"]
        if not ref.startswith("#"):
            return node
        target: Any = root
        for part in unquote(ref[1:]).split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return node
        siblings = {k: v for k, v in node.items() if k != "$ref" and k not in ANNOTATIONS}
        if siblings:
            return node  # the ref plus more: an intersection this analysis does not merge
        node, depth = target, depth + 1
    return node


def kinds(node: Any, root: dict[str, Any], depth: int = 0) -> frozenset[str]:
    """The kinds of JSON value `node` may match (a superset; all when unknown)."""
    node = resolve(node, root)
    if node is False:
        return frozenset()
    if not isinstance(node, dict) or depth > 16:
        return ALL_KINDS
    found = set(ALL_KINDS)
    declared = node.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if isinstance(declared, list):
        found &= {k for t in declared if isinstance(t, str) for k in TYPE_KINDS.get(t, ())}
    listed = values(node, root)
    if listed is not None:
        found &= {kind_of(json.loads(v)) for v in listed}
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            found &= set().union(*(kinds(b, root, depth + 1) for b in node[key]))
    if isinstance(node.get("allOf"), list):
        for b in node["allOf"]:
            found &= kinds(b, root, depth + 1)
    negated = resolve(node.get("not"), root)
    if isinstance(negated, dict) and isinstance(negated.get("type"), (str, list)) and not (
        {k for k in negated if k not in ANNOTATIONS} - {"type"}
    ):
        found -= kinds(negated, root, depth + 1)  # `not` of types only: those kinds go
    return frozenset(found)


def values(node: Any, root: dict[str, Any]) -> set[str] | None:
    """The canonical values `node` allows when it lists them (const/enum), else None."""
    node = resolve(node, root)
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {canonical(node["const"])}
    if isinstance(node.get("enum"), list):
        return {canonical(v) for v in node["enum"]}
    return None


def matches(value: Any, schema: Any, root: dict[str, Any]) -> bool:
    """Whether `value` matches `schema` (True when that cannot be decided here, e.g. a ref
    outside the definitions: only a certain mismatch may prove branches disjoint)."""
    return decide(value, schema, root) is not False


def decide(value: Any, schema: Any, root: dict[str, Any]) -> bool | None:
    """Whether `value` matches `schema` by `jsonschema` (which reads `format` as an
    annotation), or None when that cannot be decided here (an unresolvable ref, an invalid
    schema)."""
    import jsonschema  # deferred: only oneOf analysis needs it

    if not isinstance(schema, dict):
        return schema is not False
    # Local refs point into the root's definitions; carry them along.
    scoped = {k: root[k] for k in ("$defs", "definitions") if k in root}
    scoped.update(schema)
    try:
        return jsonschema.Draft202012Validator(scoped).is_valid(value)
    except Exception:  # an unresolvable ref or an invalid schema: undecided
        return None


# (lower bound, upper bound) keyword pairs whose crossing leaves no valid value.
BOUND_PAIRS = (
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)


def is_number(value: Any) -> bool:
    """True for a finite JSON number (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_satisfiable(node: dict[str, Any], path: str) -> None:
    """Raises ValueError when no value can match the schema `node`.

    xgrammar compiles some of these into a grammar that still produces output: an empty
    `anyOf` becomes the empty string (an output of "" with finish reason stop, or invalid JSON
    when nested), and a required property that the schema forbids is silently dropped.
    A nested `anyOf: []` is rejected even under an optional property for the same reason.
    """

    def empty(why: str) -> GrammarCompileError:
        return GrammarCompileError(FIELD, f"at {path}: {why}, so no value can match")

    for key in ("anyOf", "oneOf", "enum", "type"):
        if isinstance(node.get(key), list) and not node[key]:
            raise empty(f"{key!r} is an empty list")
    for low, high in BOUND_PAIRS:
        lo, hi = node.get(low), node.get(high)
        if is_number(lo) and is_number(hi) and lo > hi:
            raise empty(f"{low} ({lo}) is greater than {high} ({hi})")
    check_numeric_range(node, empty)
    if "contains" in node and node.get("minContains", 1) != 0 and not node.get("prefixItems"):
        if not kinds(node.get("items", True), {}) & kinds(node["contains"], {}):
            raise empty("no item the 'items' schema allows can match 'contains'")
    required = node.get("required")
    if not isinstance(required, list):
        return
    names = list(dict.fromkeys(r for r in required if isinstance(r, str)))
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in names:
        if props.get(name) is False:
            raise empty(f"required property {name!r} has the schema false")
    max_props = node.get("maxProperties")
    if is_number(max_props) and len(names) > max_props:
        raise empty(f"{len(names)} properties are required but maxProperties is {max_props}")
    if node.get("additionalProperties") is not False:
        return
    patterns = node.get("patternProperties")
    patterns = list(patterns) if isinstance(patterns, dict) else []
    for name in names:
        if name not in props and not matches_any(patterns, name):
            raise empty(
                f"required property {name!r} is not in 'properties' (nor matched by "
                "'patternProperties') and additional properties are not allowed"
            )


def check_numeric_range(node: dict[str, Any], empty: Any) -> None:
    """Raises `empty(...)` when minimum/maximum (inclusive or exclusive) leave no number."""
    lows = [(v, False) for v in [node.get("minimum")] if is_number(v)]
    lows += [(v, True) for v in [node.get("exclusiveMinimum")] if is_number(v)]
    highs = [(v, False) for v in [node.get("maximum")] if is_number(v)]
    highs += [(v, True) for v in [node.get("exclusiveMaximum")] if is_number(v)]
    if not lows or not highs:
        return
    # The tightest bound of each side; at equal values the exclusive one is tighter.
    lo, lo_ex = max(lows, key=lambda b: (b[0], b[1]))
    hi, hi_ex = min(highs, key=lambda b: (b[0], not b[1]))
    if lo > hi or (lo == hi and (lo_ex or hi_ex)):
        raise empty(f"the bounds leave no number between {lo} and {hi}")
    if node.get("type") == "integer":
        first = math.floor(lo) + 1 if lo_ex or lo != math.floor(lo) else lo
        last = math.ceil(hi) - 1 if hi_ex or hi != math.ceil(hi) else hi
        if first > last:
            raise empty(f"no integer lies between {lo} and {hi}")


def matches_any(patterns: list[str], name: str) -> bool:
    """True when a patternProperties regex may match `name` (also when one cannot be parsed
    here: only a certain mismatch may reject the schema)."""
    for pattern in patterns:
        try:
            if re.search(pattern, name):
                return True
        except (re.error, RecursionError, OverflowError):
            return True
    return False


# The keywords that only constrain values of one family of kinds.
_FAMILIES: tuple[tuple[frozenset[str], tuple[str, ...]], ...] = (
    (frozenset({"string"}), ("minLength", "maxLength", "pattern", "format")),
    (frozenset({"array"}), ("minItems", "maxItems", "items", "prefixItems", "uniqueItems",
                            "contains", "minContains", "maxContains")),
    (frozenset({"object"}), ("minProperties", "maxProperties", "required", "properties",
                             "patternProperties", "additionalProperties", "propertyNames",
                             "dependentRequired", "dependentSchemas")),
    (frozenset({"integer", "fraction"}), ("minimum", "maximum", "exclusiveMinimum",
                                          "exclusiveMaximum", "multipleOf")),
)


def prune(node: Any, root: dict[str, Any]) -> Any:
    """`node` without the kinds of value its own keywords leave no value of (an object
    schema requiring a name it forbids still matches every string, unless its `type` says
    otherwise): False when no kind is left, else `node` (changed in place: its `type` lists
    the kinds left, and the keywords of a removed kind are gone). Exact."""
    if not isinstance(node, dict):
        return node
    for key in ("anyOf", "oneOf", "enum", "type"):
        if isinstance(node.get(key), list) and not node[key]:
            return False
    left = set(kinds(node, root))
    if not left:
        return False
    removed: set[str] = set()
    for family, keys in _FAMILIES:
        if not family & left:
            continue
        part = {k: node[k] for k in keys if k in node}
        if isinstance(node.get("type"), str) and family == {"integer", "fraction"}:
            part["type"] = node["type"]  # the integer check reads it
        try:
            check_satisfiable(part, "#")
        except GrammarCompileError:
            removed |= family
    if not removed:
        return node
    left -= removed
    if not left or ("fraction" in left and "integer" not in left):
        return False if not left else node
    for family, keys in _FAMILIES:
        if family <= removed:
            for key in keys:
                node.pop(key, None)
    names = type_names(left)
    node["type"] = names[0] if len(names) == 1 else names
    return node
