"""The keyword rewrites of `normalize_json_schema` other than merging, negating and `oneOf`
(docs/architecture.md section 5): `not`, conditionals, dependencies, `propertyNames`,
`minProperties`, `unevaluatedProperties`, `contains`. Each changes one node in
place and is exact unless its docstring says "stricter" (never admitting an invalid value).

Pure Python.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from vllm.exceptions import UnsupportedConstraintError
from vllm.v1.structured_output.schema.facts import (
    ANNOTATIONS,
    FIELD,
    decide,
    is_negated,
    is_number,
    kinds,
    resolve,
    subschemas,
    values,
)
from vllm.v1.structured_output.schema.merge import intersect
from vllm.v1.structured_output.schema.negate import negate
from vllm.v1.structured_output.schema.regex_tree import finite_language


def rewrite_property_names(node: dict[str, Any]) -> None:
    """`propertyNames` that is a pattern or a length range becomes the equivalent
    `patternProperties` plus `additionalProperties: false`, and one listing names (or a
    pattern of a few names, `finite_language`) becomes those names listed in `properties`;
    the backends enforce both.

    Exact when the keys the node lists all match, and when the node has no
    `additionalProperties` schema that would now also apply to its listed keys.
    """
    names = node.get("propertyNames")
    if names is True or names == {}:
        del node["propertyNames"]
        return
    if not isinstance(names, dict) or "patternProperties" in node:
        return
    keys = {k for k in names if k not in ANNOTATIONS}
    if keys <= {"enum", "type"} and _names_listed(node, names):
        return
    if names.get("type", "string") != "string" or keys - {"type", "pattern", "minLength",
                                                           "maxLength"}:
        return
    low, high = names.get("minLength"), names.get("maxLength")
    if "pattern" in names:
        if low is not None or high is not None or not isinstance(names["pattern"], str):
            return  # a pattern and a length cannot be one regex without lookarounds
        regex = names["pattern"]
        # A pattern of a few names (`^[a-c]$`) is those names: with all of them listed,
        # llguidance still allowed a comma for a further key, where none fits (a dead end
        # found by the differential check).
        finite = finite_language(regex)
        if finite is not None and _names_listed(node, {"enum": finite}):
            return
    elif (low is None or isinstance(low, int)) and (high is None or isinstance(high, int)):
        regex = f"^[\\s\\S]{{{low or 0},{'' if high is None else high}}}$"
    else:
        return
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    extra = node.get("additionalProperties", True)
    try:
        if not all(re.search(regex, name) for name in listed):
            return
    except re.error:
        return
    del node["propertyNames"]
    if extra is False:
        return  # only the listed keys, which all match
    if listed and extra not in (True, {}):
        node["propertyNames"] = names  # the extra schema would reach the listed keys
        return
    node["patternProperties"] = {regex: {} if extra is True else extra}
    node["additionalProperties"] = False


def _names_listed(node: dict[str, Any], names: dict[str, Any]) -> bool:
    """`propertyNames: {"enum": [...]}` written as those names listed in `properties` (each
    with the `additionalProperties` schema unless it has its own) and nothing else allowed;
    False (and `node` unchanged) when the names are not all strings or a listed key is not
    among them."""
    allowed = names.get("enum")
    if (not isinstance(allowed, list) or not all(isinstance(n, str) for n in allowed)
            or names.get("type", "string") != "string"):
        return False
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if any(name not in allowed for name in listed):
        return False
    extra = node.get("additionalProperties", True)
    node["properties"] = {**listed, **{n: ({} if extra is True else extra)
                                       for n in allowed if n not in listed}}
    node["additionalProperties"] = False
    del node["propertyNames"]
    return True


def rewrite_min_properties(node: dict[str, Any]) -> None:
    """`minProperties: 1` asserts nothing more when a required property exists."""
    if node.get("minProperties") == 1 and isinstance(node.get("required"), list) and (
        node["required"]
    ):
        del node["minProperties"]


def spell_out_min_properties(schema: Any) -> None:
    """Rewrites, in place and in every subschema, `minProperties: 1` beside listed
    properties as "one of the listed properties is present", for llguidance (which enforces
    minProperties only when every listed property is required). Exact without additional
    properties, stricter (never wrong) with them."""
    if not isinstance(schema, dict):
        return
    _spell_min_properties(schema)
    for sub, _ in subschemas(schema, "#"):
        if not is_negated(schema, sub):
            spell_out_min_properties(sub)


def _spell_min_properties(node: dict[str, Any]) -> None:
    if node.get("minProperties") != 1:
        return
    listed = node.get("properties")
    if not isinstance(listed, dict) or not listed:
        return
    del node["minProperties"]
    node.setdefault("allOf", []).append(
        {"anyOf": [{"required": [name]} for name in listed]} if len(listed) > 1
        else {"required": list(listed)}
    )


# Keywords of an `allOf` branch whose evaluated properties are known without running it.
_PLAIN_OBJECT_KEYS = frozenset({
    "type", "properties", "patternProperties", "required", "additionalProperties",
    "minProperties", "maxProperties",
})


def rewrite_unevaluated_properties(node: dict[str, Any], root: dict[str, Any]) -> None:
    """`unevaluatedProperties` beside an `allOf` of plain object schemas: the evaluated
    properties are those any of them (or the node) lists, so it is the node's
    `additionalProperties` once those are listed on the node too."""
    if "unevaluatedProperties" not in node:
        return
    rest = node["unevaluatedProperties"]
    branches = [resolve(b, root) for b in node.get("allOf", [])]
    if any(k in node for k in ("anyOf", "oneOf", "if", "not", "dependentSchemas", "$ref")):
        return
    if not all(isinstance(b, dict) for b in branches):
        return
    for b in branches:
        if {k for k in b if k not in ANNOTATIONS} - _PLAIN_OBJECT_KEYS:
            return
    scopes = [node, *branches]
    if any("additionalProperties" in b for b in scopes):
        del node["unevaluatedProperties"]  # every property is evaluated
        return
    listed = node.setdefault("properties", {})
    patterns = {}
    for b in scopes:
        for name in b.get("properties", {}) if isinstance(b.get("properties"), dict) else ():
            listed.setdefault(name, {})
        if isinstance(b.get("patternProperties"), dict):
            patterns.update({p: {} for p in b["patternProperties"]})
    if patterns:
        node["patternProperties"] = {**patterns, **node.get("patternProperties", {})}
    del node["unevaluatedProperties"]
    node["additionalProperties"] = rest


def rewrite_contains(node: dict[str, Any], root: dict[str, Any]) -> None:
    """`contains` (with `minContains` m, default 1) becomes m leading items that match it
    (after the listed `prefixItems`, if any).
    With `maxContains`, the items after them must not match it, which is written when the
    item schema lists the values of the properties `contains` pins. Stricter than `contains`
    (the matches come first, and exactly m of them with `maxContains`), never wrong."""
    wanted = node.get("contains")
    prefix = node.get("prefixItems", [])
    if wanted is None or not isinstance(prefix, list):
        return
    low = node.get("minContains", 1)
    high = node.get("maxContains")
    if not isinstance(low, int) or isinstance(low, bool) or not 1 <= low <= 8:
        return
    if prefix and (high is not None or (is_number(node.get("maxItems"))
                                        and node["maxItems"] < len(prefix) + low)):
        return  # with listed leading items, the matches go after them (when they fit)
    if high is not None and (not isinstance(high, int) or high < low):
        return
    items = node.get("items", True)
    rest: Any = items
    limit = node.get("maxItems")
    if high is not None and not (is_number(limit) and limit <= high):
        item_schema = resolve(items, root)
        condition = resolve(wanted, root)
        if not isinstance(condition, dict) or not isinstance(item_schema, dict):
            return
        if condition.get("type") == "object" and kinds(item_schema, root) == {"object"}:
            condition = {k: v for k, v in condition.items() if k != "type"}
        negation = _negate_condition(condition, item_schema, root)
        if negation is None:
            return
        rest = {"allOf": [items, negation]}
    for key in ("contains", "minContains", "maxContains"):
        node.pop(key, None)
    match = wanted if items is True else {"allOf": [items, wanted]}
    node["prefixItems"] = [*prefix, *(copy.deepcopy(match) for _ in range(low))]
    node["items"] = rest
    node["minItems"] = max(node.get("minItems", 0), len(prefix) + low)


def _absent(names: list[str]) -> dict[str, Any]:
    """A schema an object matches when one of `names` is missing (non-objects match too)."""
    if len(names) == 1:
        return {"properties": {names[0]: False}}
    return {"anyOf": [{"properties": {name: False}} for name in names]}


def rewrite_dependencies(node: dict[str, Any]) -> None:
    """Rewrites `dependentRequired`, `dependentSchemas` and `dependencies` (draft-07's form of
    both) as the equivalent `allOf` of "the property is absent, or ..." alternatives, which
    llguidance enforces. `dependencies` is rewritten in every draft: enforcing it where the
    draft ignores it only narrows the outputs."""
    rules: list[dict[str, Any]] = []
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        table = node.get(key)
        if not isinstance(table, dict):
            continue
        for name, dep in table.items():
            if isinstance(dep, list):
                then: dict[str, Any] = {"required": [name, *dep]}
            elif isinstance(dep, (dict, bool)):
                then = {"allOf": [{"required": [name]}, dep]}
            else:
                continue  # not a schema: left for the backends to refuse
            rules.append({"anyOf": [_absent([name]), then]})
        del node[key]
    if rules:
        node.setdefault("allOf", []).extend(rules)


def rewrite_not(node: dict[str, Any], root: dict[str, Any]) -> None:
    """Replaces `not` by the schema of the values it refuses, when `negate` writes that
    exactly (within the kinds the rest of the node allows)."""
    if "not" not in node:
        return
    within = kinds({k: v for k, v in node.items() if k != "not"}, root)
    pieces, exact = negate(node["not"], root, within)
    if exact:
        del node["not"]
        node.setdefault("allOf", []).append({"anyOf": pieces} if len(pieces) != 1
                                            else pieces[0])


def rewrite_conditionals(
    node: dict[str, Any], root: dict[str, Any], conditions: list[dict[str, Any]]
) -> None:
    """Rewrites each `if`/`then`/`else` (of `node`, or of `allOf` members merged into it) as
    `anyOf [if and then, (not if) and else]` when `not if` can be written: by
    `_negate_condition` (`if` pins properties to values the node lists) or exactly by
    `negate`. The others go back unchanged (one on the node, the rest as `allOf` members)."""
    within = kinds(node, root)
    for condition in conditions:
        if "if" not in condition or ("then" not in condition and "else" not in condition):
            continue  # `if` alone, or `then`/`else` without it, asserts nothing
        test = condition["if"]
        negation = _negate_condition(test, node, root)
        if negation is None:
            pieces, exact = negate(test, root, within)
            negation = {"anyOf": pieces} if exact else None
        if negation is None:
            if "if" in node:
                node.setdefault("allOf", []).append(condition)
            else:
                node.update(condition)
            continue
        ways = [_both(test, condition.get("then", True), root),
                _both(negation, condition.get("else", True), root)]
        node.setdefault("allOf", []).append({"anyOf": [w for w in ways if w is not False]})


def _both(a: Any, b: Any, root: dict[str, Any]) -> Any:
    """A schema of the values matching `a` and `b` (one merged schema where possible)."""
    merged = intersect(a, b, root)
    return {"allOf": [a, b]} if merged is None else merged


def _negate_condition(
    condition: Any, node: dict[str, Any], root: dict[str, Any]
) -> dict[str, Any] | None:
    """A schema for the values `condition` rejects (see `_rewrite_conditional`), else None."""
    condition = resolve(condition, root)
    if not isinstance(condition, dict):
        return None
    keys = {k for k in condition if k not in ANNOTATIONS}
    pinned = condition.get("properties", {})
    required = condition.get("required", [])
    if not keys <= {"properties", "required"} or not isinstance(pinned, dict):
        return None
    if not isinstance(required, list) or not pinned and not required:
        return None
    own = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    # The condition fails for an object with a pinned property holding another of the
    # values its schema allows, or missing a required name; it holds for every non-object.
    ways: list[dict[str, Any]] = []
    for name, sub in pinned.items():
        allowed, domain = values(sub, root), values(own.get(name), root)
        if domain is None and kinds(own.get(name, True), root) == {"boolean"}:
            domain = {"true", "false"}
        if allowed is None or domain is None:
            return None
        rest = [json.loads(v) for v in sorted(domain - allowed)]
        if rest:
            ways.append({"required": [name], "properties": {name: {"enum": rest}}})
    ways.extend({"properties": {name: False}} for name in required if isinstance(name, str))
    if not ways:
        return None  # the condition holds for every value the node allows
    return {"type": "object", "anyOf": ways}


def fold_enums(node: Any, root: dict[str, Any], path: str = "#") -> None:
    """Keeps, in place, of each `enum` (or `const`) only the values its sibling keywords
    accept, and drops the siblings: xgrammar 0.2.9 and outlines enforce the listed values
    alone (`{"enum": [2.5, null], "type": "number"}` accepted null; found by the differential
    check). Exact where jsonschema decides every value (a `format` by jsonschema's own check
    of it); a node with an undecided value keeps its siblings, for the backends' checks to
    refuse, except beside a `format` jsonschema cannot check, which is refused here
    (UnsupportedConstraintError): the backends would write the values alone (`""` passed
    `format: email` on outlines). A node left with no value is `{"enum": []}`, which an
    `anyOf`/`oneOf` drops as a branch (the backends refuse it elsewhere)."""
    if not isinstance(node, dict):
        return
    listed = [node["const"]] if "const" in node else node.get("enum")
    rest = {k: v for k, v in node.items() if k not in ("enum", "const") and k not in ANNOTATIONS}
    if isinstance(listed, list) and rest:
        fmt = rest.pop("format", None)
        verdicts = [_and(decide(value, rest, root) if rest else True, _conforms(value, fmt))
                    for value in listed]
        if None not in verdicts:
            kept = [value for value, ok in zip(listed, verdicts) if ok]
            for key in [k for k in node if k not in ANNOTATIONS]:
                del node[key]
            node["enum"] = kept
            return
        if fmt is not None:
            raise UnsupportedConstraintError(
                FIELD, f"at {path}: 'enum' or 'const' beside 'format' {fmt!r}, which cannot be "
                "checked on the listed values here")
    for sub, sub_path in subschemas(node, path):
        fold_enums(sub, root, sub_path)
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches:
            left = [b for b in branches if b != _NOTHING]
            if left:
                node[key] = left
            else:
                node.clear()
                node.update(_NOTHING)
                return


def _and(a: bool | None, b: bool | None) -> bool | None:
    """Three-valued "and": False wins, then None (undecided)."""
    if a is False or b is False:
        return False
    return None if a is None or b is None else True


def _conforms(value: Any, fmt: Any) -> bool | None:
    """Whether `value` satisfies `format` `fmt` by jsonschema's check of it (True for no
    format or a value that is no string), None when jsonschema has no check of it here."""
    if fmt is None or not isinstance(value, str):
        return True
    if fmt not in _CHECKED_FORMATS:
        return None
    import jsonschema  # deferred, as in `decide`

    return jsonschema.FormatChecker(formats=[fmt]).conforms(value, fmt)


# The formats jsonschema checks by itself; the others need optional packages (without them
# its `time` check refuses every time).
_CHECKED_FORMATS = frozenset({"date", "email", "ipv4", "ipv6", "uuid"})


# The schema no value matches, as fold_enums writes it.
_NOTHING: dict[str, Any] = {"enum": []}
