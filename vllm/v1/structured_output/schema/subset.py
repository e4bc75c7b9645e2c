"""Which JSON-schema keywords the compatibility backends (outlines, lm-format-enforcer)
enforce, checked on the normalized schema before they compile it.

Both libraries skip keywords they do not implement (outlines ignores `minimum`, an object's
`minProperties`, `patternProperties`; lm-format-enforcer ignores others), so an output could
violate the schema. `check_subset` walks the schema (after `normalize_json_schema`) and raises
UnsupportedConstraintError at the first keyword outside the backend's `SchemaSubset`, naming
the keyword and the backend. What a backend generates may be a subset of what the schema
allows (only listed properties, properties in schema order): every output still validates.

Pure Python; imports no backend library.
"""

from __future__ import annotations

import re
import re._parser as sre_parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm.exceptions import UnsupportedConstraintError
from vllm.v1.structured_output.schema.facts import kinds
from vllm.v1.structured_output.schema.regex_dialect import strip_anchors
from vllm.v1.structured_output.schema.regex_tree import plain_children

_FIELD = "structured_outputs.json"

# Keywords that assert nothing.
ANNOTATIONS = frozenset({
    "$schema", "$id", "id", "$anchor", "$comment", "$defs", "definitions", "$vocabulary",
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
    "contentMediaType", "contentEncoding",
})

_MAPS = ("properties", "$defs", "definitions")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SINGLES = ("items", "additionalProperties")

# JSON strings may not hold these raw: a pattern that could produce one is refused when the
# backend inserts patterns into its JSON-string rule unchecked.
_UNSAFE_IN_STRING = frozenset(range(0x20)) | {ord('"'), ord("\\")}


@dataclass(frozen=True)
class SchemaSubset:
    """What one backend enforces."""

    backend: str
    keywords: frozenset[str]
    formats: frozenset[str]
    # The backend puts `pattern` inside its JSON-string rule as is (outlines): only patterns
    # that can never write a quote, a backslash or a control character are safe.
    raw_patterns: bool = False
    # The backend handles `const`/`enum` values only when they are strings needing no JSON
    # escape (lm-format-enforcer fails on other values and writes escapes wrongly).
    plain_string_literals: bool = False
    # The backend drops the other keywords of a node whose `type` is a list
    # (lm-format-enforcer: `["string", "null"]` with `maxLength`).
    bare_type_lists: bool = False
    # The backend writes only JSON numbers, and only integers for `integer` (lm-format-enforcer
    # 0.11 accepts `76.E02`, `0E3715` for an integer, -0.5 for `["string", "integer"]`).
    exact_numbers: bool = True
    # The backend enforces `additionalProperties: false` on an object that lists no property,
    # and `maxItems: 0` (lm-format-enforcer reads both as absent).
    empty_limits: bool = True
    # The backend counts items that are `null`, booleans or arrays right against `maxItems`
    # (lm-format-enforcer 0.11 counts them about twice: `maxItems: 3` took two `null`s, and
    # its cap of 20 items about 11; found by the differential check).
    counts_literal_items: bool = True


def _subschemas(node: dict[str, Any]) -> Iterator[Any]:
    for key in _MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            yield from value.values()
    for key in _LISTS:
        value = node.get(key)
        if isinstance(value, list):
            yield from value
    for key in _SINGLES:
        value = node.get(key)
        if isinstance(value, dict):
            yield value


def _schema_nodes(schema: Any) -> list[dict[str, Any]]:
    """Every subschema object of `schema` (itself included) reached through schema positions,
    never through values (`enum`, `const`, `default`): the in-place rewrites below must not
    change a literal that happens to look like a schema."""
    nodes, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            nodes.append(node)
            stack.extend(_subschemas(node))
    return nodes


def _refuse(subset: SchemaSubset, what: str) -> UnsupportedConstraintError:
    return UnsupportedConstraintError(_FIELD, f"{what} (unsupported by {subset.backend})")


def check_subset(schema: Any, subset: SchemaSubset) -> None:
    """Raises UnsupportedConstraintError at the first keyword (or keyword combination) of the
    normalized `schema` that `subset.backend` does not enforce exactly."""
    for node in _schema_nodes(schema):
        for key in node:
            if key not in subset.keywords and key not in ANNOTATIONS:
                raise _refuse(subset, f"schema keyword {key!r} cannot be enforced")
        _check_node(node, subset)
        _check_item_count(node, subset, schema)


def _check_item_count(node: dict[str, Any], subset: SchemaSubset, root: Any) -> None:
    if subset.counts_literal_items or "items" not in node:
        return
    high = node.get("maxItems")
    if (high is None or high > 2) and kinds(node["items"], root) & {"null", "boolean", "array"}:
        raise _refuse(subset, "array items that may be null, booleans or arrays beside a "
                      "'maxItems' above 2 or none (the library counts them about twice)")


def _check_node(node: dict[str, Any], subset: SchemaSubset) -> None:
    """The combinations the libraries get wrong even where each keyword alone is fine."""
    if node.get("enum") == []:
        raise _refuse(subset, "'enum' with no value left once its sibling keywords are applied")
    if isinstance(node.get("enum"), list) and any(
            k not in ("enum", "const") and k not in ANNOTATIONS for k in node):
        raise _refuse(subset, "keywords beside 'enum' (the library enforces the values alone)")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise _refuse(subset, "'allOf' with several schemas cannot be enforced")
    required = node.get("required") or []
    listed = node.get("properties") or {}
    extra = node.get("additionalProperties")
    if listed and extra is not None and extra is not False:
        # Both libraries write the listed properties only (outlines and lm-format-enforcer
        # refused {"a": "x", "b": "y"} for `additionalProperties: {type: string}`; found by
        # the differential check): left unset, that is the closed-world narrowing.
        raise _refuse(subset, "'additionalProperties' beside 'properties' (only the listed "
                      "properties are written)")
    missing = [name for name in required if name not in listed]
    if missing:
        raise _refuse(subset, f"required property {missing[0]!r} that 'properties' does not list")
    if node.get("uniqueItems") is True and node.get("maxItems", 2) > 1:
        raise _refuse(subset, "'uniqueItems' cannot be enforced")
    prefix = node.get("prefixItems")
    if isinstance(prefix, list):
        # The libraries write exactly the prefix items (`spell_out_tuples` writes the shorter
        # ones as tuples of their own), and none after them.
        if node.get("minItems", 0) > len(prefix) or node.get("maxItems", len(prefix)) < len(prefix):
            raise _refuse(subset, "'minItems'/'maxItems' beside 'prefixItems'")
        if node.get("items", False) is not False:
            raise _refuse(subset, "'items' after 'prefixItems' (only the listed items are written)")
    if subset.bare_type_lists and isinstance(node.get("type"), list):
        others = sorted(k for k in node if k != "type" and k not in ANNOTATIONS)
        if others:
            raise _refuse(subset, f"a list of types beside {others[0]!r}")
    if subset.plain_string_literals:
        values = list(node.get("enum") or []) + ([node["const"]] if "const" in node else [])
        for value in values:
            if not isinstance(value, str) or any(ord(c) in _UNSAFE_IN_STRING for c in value):
                raise _refuse(
                    subset, f"'enum'/'const' value {value!r} (only strings needing no escape)"
                )
    if not subset.exact_numbers:
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if "integer" in types or "number" in types:
            raise _refuse(subset, "numbers (type 'integer' or 'number')")
        if not any(k in node for k in ("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref")):
            raise _refuse(subset, "a value of any type (numbers included)")
        if "array" in types and "items" not in node and "prefixItems" not in node:
            raise _refuse(subset, "array items of any type (numbers included)")
        if ("object" in types and not node.get("properties")
                and node.get("additionalProperties", True) is True):
            raise _refuse(subset, "an object whose properties may hold any type (numbers included)")
    if not subset.empty_limits:
        if node.get("additionalProperties") is False and not node.get("properties"):
            raise _refuse(subset, "'additionalProperties: false' on an object listing no property")
        if node.get("maxItems") == 0:
            raise _refuse(subset, "'maxItems: 0'")
    fmt = node.get("format")
    if fmt is not None and fmt not in subset.formats:
        raise _refuse(subset, f"string format {fmt!r}")
    if ("pattern" in node or fmt is not None) and ("minLength" in node or "maxLength" in node):
        raise _refuse(subset, "'pattern' or 'format' together with 'minLength'/'maxLength'")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and subset.raw_patterns and not _json_safe(pattern):
        raise _refuse(
            subset,
            f"pattern {pattern!r} (it could write a quote, a backslash, a control character "
            "or any character; use literal characters and classes)",
        )


def spell_out_tuples(schema: Any) -> None:
    """Rewrites, in place, each array (`type: array`) whose `prefixItems` may stop before its
    last listed item into an `anyOf` of whole tuples, one per allowed length: outlines writes
    every listed item (it refused `[]` for one optional item; found by the differential
    check). Exact: the shorter tuples have no item after the listed ones."""
    for node in _schema_nodes(schema):
        _spell_out_tuple(node)


def _spell_out_tuple(schema: dict[str, Any]) -> None:
    prefix = schema.get("prefixItems")
    low, high = schema.get("minItems", 0), schema.get("maxItems")
    if (schema.get("type") != "array" or not isinstance(prefix, list) or not _count(low)
            or not (high is None or _count(high)) or low >= len(prefix)):
        return
    top = len(prefix) if high is None else min(high, len(prefix))
    # Each shorter tuple keeps the array's other keywords (`contains`, `uniqueItems`), so the
    # subset check still sees them: dropping them let `[]` pass a `contains` (found by the
    # differential check).
    rest = {k: v for k, v in schema.items()
            if k not in ("minItems", "maxItems", "prefixItems", "items") and k not in ANNOTATIONS}
    branches: list[Any] = [
        {**rest, "prefixItems": prefix[:k], "items": False} if k else {**rest, "maxItems": 0}
        for k in range(low, min(top + 1, len(prefix)))
    ]
    if top == len(prefix):
        branches.append({k: v for k, v in schema.items() if k not in ("minItems", "maxItems")})
    for key in [k for k in schema if k not in ANNOTATIONS]:
        del schema[key]
    schema["anyOf"] = branches


_EVERY_TYPE = ("null", "boolean", "number", "string", "array", "object")


def type_open_values(schema: Any) -> None:
    """Writes, in place, each subschema that constrains nothing (`true`, `{}` or annotations
    only) as the list of every JSON type. outlines-core 0.2.14 writes an unconstrained value
    as an alternation it does not group: text could follow a `null` (`{"c":null641.5}`, not
    JSON) and `{"a":1,"b":null}` was refused (found by the differential check). Exact: the
    list admits every JSON value."""
    for node in _schema_nodes(schema):
        for key in _MAPS:
            if isinstance(node.get(key), dict):
                node[key] = {name: _typed(sub) for name, sub in node[key].items()}
        for key in _LISTS:
            if isinstance(node.get(key), list):
                node[key] = [_typed(sub) for sub in node[key]]
        for key in _SINGLES:
            if key in node:
                node[key] = _typed(node[key])


def _typed(sub: Any) -> Any:
    """`sub` written as the list of every type when it constrains nothing, else itself."""
    if sub is True or (isinstance(sub, dict) and all(k in ANNOTATIONS for k in sub)):
        return {**(sub if isinstance(sub, dict) else {}), "type": list(_EVERY_TYPE)}
    return sub


def drop_absent_properties(schema: Any) -> None:
    """Removes, in place, listed properties whose schema is `false` (the name may not
    appear) from objects of a backend that writes only listed properties, and writes `true`
    as `{}`: lm-format-enforcer fails on a boolean schema once it starts the name (a dead
    end the differential check found). An object left listing nothing gets
    `additionalProperties: false`, as it was (no other name is written either)."""
    for node in _schema_nodes(schema):
        listed = node.get("properties")
        if isinstance(listed, dict) and any(isinstance(sub, bool) for sub in listed.values()):
            # `true` is `{}` (which the checks then read), `false` goes.
            node["properties"] = {n: {} if sub is True else sub
                                  for n, sub in listed.items() if sub is not False}
            if not node["properties"] and "additionalProperties" not in node and (
                    "patternProperties" not in node):
                node["additionalProperties"] = False


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_narrow(regex: str, max_class: int = 512) -> bool:
    r"""True when `regex` parses (Python's syntax) and every character class in it is a
    positive class of at most `max_class` characters (no `.`, negated classes, `\S`, `\W`,
    `\D`): what a character-level parser can walk over a vocabulary in milliseconds."""
    try:
        parsed = sre_parse.parse(strip_anchors(regex))
    except (re.error, RecursionError):
        return False
    sizes = {"CATEGORY_DIGIT": 10, "CATEGORY_WORD": 63}

    def ok(items: Any) -> bool:
        for op, arg in items:
            name = str(op)
            if name == "IN":
                size = 0
                for member_op, member in arg:
                    member_name = str(member_op)
                    if member_name == "LITERAL":
                        size += 1
                    elif member_name == "RANGE":
                        size += member[1] - member[0] + 1
                    elif member_name == "CATEGORY" and str(member) in sizes:
                        size += sizes[str(member)]
                    else:
                        return False
                if size > max_class:
                    return False
            elif name != "LITERAL":
                parts = plain_children(op, arg)
                if parts is None or not all(ok(part) for part in parts):
                    return False
        return True

    return ok(parsed)


def _json_safe(pattern: str) -> bool:
    """True when every string `pattern` matches needs no JSON escape: literals, positive
    classes, `\\d`/`\\w`, groups, alternations and repeats of safe characters only."""
    try:
        parsed = sre_parse.parse(strip_anchors(pattern))
    except re.error:
        return False

    def ok(items: Any) -> bool:
        for op, arg in items:
            name = str(op)
            if name == "LITERAL":
                if arg in _UNSAFE_IN_STRING:
                    return False
            elif name == "IN":
                for member_op, member in arg:
                    member_name = str(member_op)
                    if member_name == "LITERAL" and member not in _UNSAFE_IN_STRING:
                        continue
                    if member_name == "RANGE" and not any(
                        c in _UNSAFE_IN_STRING for c in range(member[0], min(member[1], 0x7F) + 1)
                    ):
                        continue
                    if member_name == "CATEGORY" and str(member) in (
                        "CATEGORY_DIGIT", "CATEGORY_WORD"
                    ):
                        continue
                    return False  # negation, \s, \W, ...
            else:
                parts = plain_children(op, arg)  # None: `.`, anchors, lookarounds, backrefs
                if parts is None or not all(ok(part) for part in parts):
                    return False
        return True

    return ok(parsed)
