"""JSON-schema preparation for the xgrammar backend: rejects what xgrammar would not enforce.

`prepare_json_schema` returns a copy of a request's schema ready for xgrammar, after
checking it: keywords xgrammar 0.2.9 accepts but silently ignores (so outputs could violate
the schema) and schemas no value can satisfy (which xgrammar would compile into an empty or
invalid output) are rejected with a GrammarCompileError naming the location.

Separate from the backend because these checks read only the schema: pure Python that
imports neither xgrammar nor numpy.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

from vllm.exceptions import GrammarCompileError
from vllm.v1.structured_output.grammar_checks import find_lookaround

# xgrammar accepts these keywords but does not enforce them.
_UNENFORCED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_SINGLES = ("additionalProperties", "items", "additionalItems", "propertyNames")


def prepare_json_schema(
    schema: dict[str, Any] | bool, *, disable_additional_properties: bool = False
) -> dict[str, Any] | bool:
    """Returns a copy of `schema` ready for xgrammar.

    Raises ValueError naming the location and keyword when the schema uses a feature xgrammar
    would not enforce, or when no value can satisfy it (see `_check_satisfiable`). With
    `disable_additional_properties`, object schemas get `additionalProperties: false` unless
    they set it.
    """
    if schema is False:
        raise GrammarCompileError("structured_outputs.json", "the schema `false` accepts no value")
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise GrammarCompileError(
            "structured_outputs.json",
            f"a schema must be a JSON object, got {type(schema).__name__}"
        )
    out = copy.deepcopy(schema)
    _prepare_node(out, "#", disable_additional_properties)
    return out


def _prepare_node(node: Any, path: str, no_extra: bool) -> None:
    if not isinstance(node, dict):
        return

    def bad(why: str) -> ValueError:
        return GrammarCompileError(
            "structured_outputs.json",
            f"at {path}: {why} (unsupported by xgrammar)"
        )

    for key in _UNENFORCED_KEYWORDS:
        if key in node:
            raise bad(f"the {key!r} keyword is not supported")
    if node.get("uniqueItems") is True and node.get("maxItems", 2) > 1:
        raise bad("'uniqueItems: true' is not supported")
    if "multipleOf" in node:
        whole = isinstance(node["multipleOf"], int) and not isinstance(node["multipleOf"], bool)
        if not whole or node.get("type") != "integer":
            raise bad("'multipleOf' is only supported on integers (type 'integer', whole divisor)")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise bad("'allOf' with more than one schema is not supported")
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        opener = find_lookaround(pattern)
        if opener is not None:
            raise bad(f"pattern {pattern!r} uses a lookaround {opener!r}")
    if "minLength" in node or "maxLength" in node:
        for key in ("pattern", "format"):
            if key in node:
                raise bad(f"{key!r} combined with minLength/maxLength is not supported")
    if no_extra and "additionalProperties" not in node:
        if node.get("type") == "object" or "properties" in node:
            node["additionalProperties"] = False
    _check_satisfiable(node, path)

    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _prepare_node(sub, f"{path}/{key}/{name}", no_extra)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _prepare_node(sub, f"{path}/{key}/{i}", no_extra)
    for key in _SCHEMA_SINGLES:
        _prepare_node(node.get(key), f"{path}/{key}", no_extra)


# (lower bound, upper bound) keyword pairs whose crossing leaves no valid value.
_BOUND_PAIRS = (
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_satisfiable(node: dict[str, Any], path: str) -> None:
    """Raises ValueError when no value can match the schema `node`.

    xgrammar compiles some of these into a grammar that still produces output: an empty
    `anyOf` becomes the empty string (an output of "" with finish reason stop, or invalid JSON
    when nested), and a required property that the schema forbids is silently dropped.
    A nested `anyOf: []` is rejected even under an optional property for the same reason.
    """

    def empty(why: str) -> ValueError:
        return GrammarCompileError(
            "structured_outputs.json",
            f"at {path}: {why}, so no value can match"
        )

    for key in ("anyOf", "oneOf", "enum", "type"):
        if isinstance(node.get(key), list) and not node[key]:
            raise empty(f"{key!r} is an empty list")
    for low, high in _BOUND_PAIRS:
        lo, hi = node.get(low), node.get(high)
        if _is_number(lo) and _is_number(hi) and lo > hi:
            raise empty(f"{low} ({lo}) is greater than {high} ({hi})")
    _check_numeric_range(node, empty)
    required = node.get("required")
    if not isinstance(required, list):
        return
    names = [r for r in dict.fromkeys(required) if isinstance(r, str)]
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in names:
        if props.get(name) is False:
            raise empty(f"required property {name!r} has the schema false")
    max_props = node.get("maxProperties")
    if _is_number(max_props) and len(names) > max_props:
        raise empty(f"{len(names)} properties are required but maxProperties is {max_props}")
    if node.get("additionalProperties") is not False:
        return
    patterns = node.get("patternProperties")
    patterns = list(patterns) if isinstance(patterns, dict) else []
    for name in names:
        if name not in props and not _matches_any(patterns, name):
            raise empty(
                f"required property {name!r} is not in 'properties' (nor matched by "
                "'patternProperties') and additional properties are not allowed"
            )


def _check_numeric_range(node: dict[str, Any], empty: Any) -> None:
    """Raises `empty(...)` when minimum/maximum (inclusive or exclusive) leave no number."""
    lows = [(v, False) for v in [node.get("minimum")] if _is_number(v)]
    lows += [(v, True) for v in [node.get("exclusiveMinimum")] if _is_number(v)]
    highs = [(v, False) for v in [node.get("maximum")] if _is_number(v)]
    highs += [(v, True) for v in [node.get("exclusiveMaximum")] if _is_number(v)]
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


def _matches_any(patterns: list[str], name: str) -> bool:
    """True when a patternProperties regex may match `name` (also when one cannot be parsed
    here: only a certain mismatch may reject the schema)."""
    for pattern in patterns:
        try:
            if re.search(pattern, name):
                return True
        except (re.error, RecursionError, OverflowError):
            return True
    return False
