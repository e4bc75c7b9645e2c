"""xgrammar's gaps in JSON Schema (docs/architecture.md section 5): `adapt_for_xgrammar`
writes what xgrammar 0.2.9 takes only in another form (length bounds beside a pattern or
format, numbers that are not integers); `check_xgrammar_support` then refuses, with
UnsupportedConstraintError, what xgrammar accepts but would not enforce (so an output could
violate the schema) or refuses wrongly; the `auto` backend then tries llguidance. Both read
schemas already normalized by `normalize_json_schema`.

Pure Python.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vllm.exceptions import UnsupportedConstraintError
from vllm.v1.structured_output.schema.facts import (
    ANNOTATIONS,
    FIELD,
    drop_fraction_branches,
    is_fraction_schema,
    is_number,
    subschemas,
)
from vllm.v1.structured_output.schema.grammar_checks import find_lookaround
from vllm.v1.structured_output.schema.lengths import fold_lengths

# xgrammar accepts these keywords but does not enforce them.
_XGRAMMAR_UNENFORCED = (
    "not", "if", "then", "else", "contains", "minContains", "maxContains", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
    "unevaluatedItems",
)
# String formats each backend enforces (measured: xgrammar 0.2.9 accepts any string for a
# format it does not know; llguidance 1.9 refuses one it does not know).
XGRAMMAR_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer",
})
GUIDANCE_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid",
})
KNOWN_FORMATS = XGRAMMAR_FORMATS | GUIDANCE_FORMATS

# A JSON-schema pattern with a ranged repeat ("{1,5}") and a group under a quantifier
# ("(...)?"): xgrammar 0.2.9 can accept strings such a pattern rejects ("^[A-Z]{1,5}(\.[A-Z]
# {1,2})?$" accepted "RGBOKV"). Top-level regex constraints compile correctly.
_RANGED_REPEAT = re.compile(r"\{\d+,\d*\}")
_REPEATED_GROUP = re.compile(r"\)[?*+{]")

# xgrammar's JSON converter refuses numeric bounds past this (int64 as a double).
_XGRAMMAR_MAX_BOUND = 2**63 - 1


# "A number that is not an integer" (`fraction_schema`) has no xgrammar keyword: the node
# becomes a string constant holding this mark and a sign, and the string's rule in the EBNF
# xgrammar writes becomes `_FRACTION_RULE`: at most 7 digits before the point and 8 after it,
# no exponent, the last digit not 0. Stricter than the schema, never wrong: such a number is
# not an integer, and with at most 15 digits its double is not one either (DBL_DIG).
_FRACTION_MARK = "vllm:fraction:"
_FRACTION_LIMIT = 10**7
_FRACTION_RULE = '(("0" | [1-9] [0-9]{0,6}) "." [0-9]{0,7} [1-9])'
_FRACTION_SIGNS = {"both": '"-"? ', "negative": '"-" ', "positive": ""}


def adapt_for_xgrammar(schema: dict[str, Any] | bool) -> None:
    """Rewrites, in place, the parts of a normalized schema xgrammar takes only in another
    form: length bounds beside a pattern or format (schema_lengths.py) and numbers that are
    not integers (a marked constant that `write_fraction_rules` turns into a rule)."""
    if not isinstance(schema, dict):
        return
    fold_lengths(schema)
    if _FRACTION_MARK not in json.dumps(schema):  # a request cannot forge a mark
        _mark_fractions(schema)
    drop_fraction_branches(schema)  # those left unmarked, where another branch remains


def _mark_fractions(node: Any) -> None:
    if not isinstance(node, dict):
        return
    if is_fraction_schema(node):
        lows = [node[k] for k in ("minimum", "exclusiveMinimum") if k in node]
        highs = [node[k] for k in ("maximum", "exclusiveMaximum") if k in node]
        if not all(is_number(v) for v in lows + highs):
            return
        # Positive fractions lie in (0, limit), negative ones in (-limit, 0).
        positive = all(v <= 0 for v in lows) and all(v >= _FRACTION_LIMIT for v in highs)
        negative = all(v <= -_FRACTION_LIMIT for v in lows) and all(v >= 0 for v in highs)
        if positive or negative:
            sign = "both" if positive and negative else "positive" if positive else "negative"
            node.clear()
            node["const"] = _FRACTION_MARK + sign
        return  # else its `not` stays, for the check to refuse
    for sub, _ in subschemas(node, "#"):
        _mark_fractions(sub)


def write_fraction_rules(ebnf: str) -> tuple[str, bool]:
    """`ebnf` (xgrammar's conversion of a schema `adapt_for_xgrammar` marked) with each
    marked constant replaced by the number rule; whether there was one."""
    changed = False
    for sign, prefix in _FRACTION_SIGNS.items():
        literal = '"\\"' + _FRACTION_MARK + sign + '\\""'
        if literal in ebnf:
            ebnf = ebnf.replace(literal, "(" + prefix + _FRACTION_RULE + ")")
            changed = True
    return ebnf, changed


def check_xgrammar_support(schema: dict[str, Any] | bool) -> None:
    """Raises UnsupportedConstraintError at the first keyword xgrammar would not enforce.

    `schema` is the output of `normalize_json_schema`.
    """
    if isinstance(schema, dict):
        _check_xgrammar_node(schema, "#")


def _check_xgrammar_node(node: Any, path: str) -> None:
    if not isinstance(node, dict):
        return

    def bad(why: str) -> UnsupportedConstraintError:
        return UnsupportedConstraintError(FIELD, f"at {path}: {why} (unsupported by xgrammar)")

    if is_fraction_schema(node):
        raise bad(
            "a number that is not an integer (a 'oneOf' of 'integer' and 'number', or 'not' "
            "of 'integer') is supported only without bounds, or with bounds that admit every "
            f"positive or every negative one of magnitude below {_FRACTION_LIMIT}"
        )
    for key in _XGRAMMAR_UNENFORCED:
        if key in node:
            raise bad(f"the {key!r} keyword is not supported")
    for key in ("properties", "patternProperties"):
        table = node.get(key) if isinstance(node.get(key), dict) else {}
        for name, sub in table.items():
            if sub is False:  # xgrammar 0.2.9: "Schema 'false' cannot accept any value"
                raise bad(f"{key} {name!r} has the schema false (the name may not appear)")
    if node.get("uniqueItems") is True and node.get("maxItems", 2) > 1:
        raise bad("'uniqueItems: true' is not supported")
    if "multipleOf" in node:
        whole = isinstance(node["multipleOf"], int) and not isinstance(node["multipleOf"], bool)
        if not whole or node.get("type") != "integer":
            raise bad("'multipleOf' is only supported on integers (type 'integer', whole divisor)")
        bounds = [k for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
                  if k in node]
        if bounds:
            # xgrammar 0.2.9 warns "range + multipleOf combination not yet supported;
            # ignoring multipleOf" and enforces the bound alone.
            raise bad(f"'multipleOf' beside {bounds[0]!r} is not supported")
    if node.get("enum") == []:
        raise bad("'enum' with no value left once its sibling keywords are applied")
    if (isinstance(node.get("enum"), list) or "const" in node) and any(
            k not in ("enum", "const") and k not in ANNOTATIONS for k in node):
        others = sorted(k for k in node if k not in ("enum", "const") and k not in ANNOTATIONS)
        raise bad(f"keywords beside 'enum' ({', '.join(others)}) are not enforced")
    _check_pattern_overlap(node, bad)
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise bad("'allOf' with more than one schema is not supported")
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if is_number(node.get(key)) and not -_XGRAMMAR_MAX_BOUND - 1 <= node[key] <= _XGRAMMAR_MAX_BOUND:
            raise bad(f"{key!r} {node[key]} is beyond 64-bit integers")
    for key in ("$ref", "anyOf", "allOf"):
        if key in node:
            others = sorted(k for k in node if k != key and k not in ANNOTATIONS)
            if others:
                raise bad(f"keywords beside {key!r} ({', '.join(others)}) are not supported")
    if isinstance(node.get("format"), str) and node["format"] not in XGRAMMAR_FORMATS:
        raise bad(f"format {node['format']!r} is not supported")
    if node.get("format") == "ipv4":
        # Found by the differential check: "088.81.46.77" passed.
        raise bad("format 'ipv4' is written with leading zeros ('004'), which it forbids")
    if node.get("format") in ("date", "date-time"):
        # Found by the differential check: "2023-02-30" passed.
        raise bad(f"format {node['format']!r} admits days past the month's end")
    extra = node.get("additionalProperties")
    if isinstance(node.get("patternProperties"), dict) and isinstance(extra, dict):
        # "xq": "a" passed the additional schema though "^x" asked for an array.
        raise bad("'patternProperties' beside an 'additionalProperties' schema (a key "
                  "matching a pattern may take the additional schema instead)")
    if "format" in node and "pattern" in node:
        # xgrammar 0.2.9 enforces the format alone ("ftp://a" passed `^https?://` beside
        # `format: uri`; found by a walk through the corpus).
        raise bad("'pattern' combined with 'format' is not supported")
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        opener = find_lookaround(pattern)
        if opener is not None:
            raise bad(f"pattern {pattern!r} uses a lookaround {opener!r}")
        if _RANGED_REPEAT.search(pattern) and _REPEATED_GROUP.search(pattern):
            raise bad(
                f"pattern {pattern!r} has a ranged repeat and a repeated or optional group, "
                "which xgrammar 0.2.9 can match wrongly"
            )
        if optional_group_with_repeat(pattern):
            raise bad(
                f"pattern {pattern!r} has an optional group holding an unbounded repeat, "
                "which xgrammar 0.2.9 can match wrongly"
            )
    if "minLength" in node or "maxLength" in node:
        for key in ("pattern", "format"):
            if key in node:
                raise bad(f"{key!r} combined with minLength/maxLength is not supported")
    for sub, sub_path in subschemas(node, path):
        _check_xgrammar_node(sub, sub_path)


def _check_pattern_overlap(node: dict[str, Any], bad: Any) -> None:
    """Refuses a `patternProperties` pattern matching a name listed in `properties` with
    another schema: xgrammar 0.2.9 lets that property take either schema where JSON Schema
    requires both (`{"a": 12.5}` passed `properties: {a: integer}` beside `"^.$": {}`)."""
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    patterns = node.get("patternProperties")
    if not listed or not isinstance(patterns, dict):
        return
    for pattern, pattern_schema in patterns.items():
        for name, schema in listed.items():
            try:
                hit = re.search(pattern, name) is not None
            except re.error:
                hit = True  # no verdict: assume the worst
            if hit and pattern_schema != schema:
                raise bad(f"patternProperties {pattern!r} matches the listed property "
                          f"{name!r} with another schema")


def optional_group_with_repeat(pattern: str) -> bool:
    """True when `pattern` has a group made optional (`(...)?`) that holds a `*` or `+`:
    xgrammar 0.2.9 then also accepts strings that skip the group's first character
    (`^a(x.*)?$` accepted "ay", `^\\.(/.*)?$` accepted "..x")."""
    stack: list[bool] = []  # per open group: whether it holds an unbounded repeat
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            stack.append(False)
        elif c in "*+" and stack:
            stack[-1] = True
        elif c == ")" and stack:
            repeated = stack.pop()
            if repeated and pattern[i + 1:i + 2] == "?":
                return True
            if repeated and stack:
                stack[-1] = True  # the outer group holds it too
        i += 1
    return False
