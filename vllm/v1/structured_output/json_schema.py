"""JSON-schema preparation shared by the backends: the schema's own draft semantics, exact
`oneOf`, and refusals of what a backend would not enforce (docs/architecture.md section 5).

- `normalize_json_schema` (every backend): returns a copy in the form the backends read, with
  the semantics of the schema's `$schema` draft made explicit (default 2020-12): before
  2019-09 the keywords beside a `$ref` are ignored, so they are dropped; draft-04's boolean
  `exclusiveMinimum`/`exclusiveMaximum` become numbers; an array-form `items` becomes
  `prefixItems`. Definitions the root never references are dropped (schema_refs.py). Then,
  node by node, exact rewrites:
  - `allOf` members merge into their node, and keywords beside `anyOf` (and several `anyOf`
    rules) are distributed into its branches (schema_merge.py), so xgrammar, which takes
    neither, enforces them; intersecting two recursive definitions inside their own
    intersection is refused by name (it never ends);
  - `not` of a schema whose refusals have a schema (a type, listed values, bounds, required
    names, property schemas) becomes that schema (schema_negate.py);
  - `if`/`then`/`else` becomes `anyOf [if and then, (not if) and else]` when `not if` can be
    written, also for the conditionals of merged `allOf` members;
  - `oneOf` becomes an `anyOf` of branches no two values share (schema_one_of.py): disjoint
    branches stay as they are, overlapping ones each keep what the others refuse. No backend
    enforces "exactly one"; a `oneOf` that cannot be made exclusive is refused naming two
    branches, unless the server treats `oneOf` as `anyOf` by choice (`one_of_as_any_of`);
  - `dependencies`/`dependentRequired`/`dependentSchemas` become `allOf` rules;
    `propertyNames` (a pattern or a length) becomes `patternProperties`;
    `unevaluatedProperties` beside an `allOf` of plain objects becomes
    `additionalProperties`.
  Stricter rules that never admit an invalid value: `uniqueItems: true` allows at most one
  item (no grammar can express "all items differ"; an array that must hold two or more is
  refused), `contains` puts its matches first, an overlapping `oneOf` branch whose exact
  remainder has no schema or too many alternatives keeps part of it, and, for llguidance,
  `minProperties: 1` (`spell_out_min_properties`). None of these run inside `not` or `if`,
  where narrowing would widen the schema. A `format` no backend knows is an annotation, as
  the JSON Schema specification says, and is dropped. The result is labelled 2020-12, the
  draft its keywords are written in. Schemas no value can satisfy, and keywords of the wrong
  JSON type, are refused.
- `check_xgrammar_support`: raises UnsupportedConstraintError at the first keyword xgrammar
  0.2.9 accepts but does not enforce (so an output could violate the schema), or refuses
  wrongly (a property with the schema `false`); the `auto` backend then tries llguidance.

Pure Python that imports neither xgrammar nor numpy.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.v1.structured_output.grammar_checks import find_lookaround
from vllm.v1.structured_output.schema_facts import (
    ANNOTATIONS,
    FIELD as _FIELD,
    check_satisfiable,
    is_number,
    kinds,
    resolve,
    values,
)
from vllm.v1.structured_output.schema_merge import (
    RecursiveIntersection,
    distribute_any_of,
    intersect,
    merge_all_of,
    pop_conditions,
)
from vllm.v1.structured_output.schema_negate import negate
from vllm.v1.structured_output.schema_one_of import rewrite_one_of
from vllm.v1.structured_output.schema_refs import drop_unreferenced_definitions
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"


# xgrammar accepts these keywords but does not enforce them.
_XGRAMMAR_UNENFORCED = (
    "not", "if", "then", "else", "contains", "minContains", "maxContains",
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
_KNOWN_FORMATS = XGRAMMAR_FORMATS | GUIDANCE_FORMATS

# A JSON-schema pattern with a ranged repeat ("{1,5}") and a group under a quantifier
# ("(...)?"): xgrammar 0.2.9 can accept strings such a pattern rejects ("^[A-Z]{1,5}(\.[A-Z]
# {1,2})?$" accepted "RGBOKV"). Top-level regex constraints compile correctly.
_RANGED_REPEAT = re.compile(r"\{\d+,\d*\}")
_REPEATED_GROUP = re.compile(r"\)[?*+{]")

# xgrammar's JSON converter refuses numeric bounds past this (int64 as a double).
_XGRAMMAR_MAX_BOUND = 2**63 - 1

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_SINGLES = (
    "additionalProperties", "items", "additionalItems", "propertyNames", "not", "if", "then",
    "else", "contains", "unevaluatedItems", "unevaluatedProperties",
)
# `$schema` values of the drafts in which keywords beside `$ref` are ignored.
_LEGACY_REF_DRAFTS = re.compile(r"draft-0[3-7]")


def _subschemas(node: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    """Every direct subschema of `node` with its location."""
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield sub, f"{path}/{key}/{name}"
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield sub, f"{path}/{key}/{i}"
    for key in _SCHEMA_SINGLES:
        if isinstance(node.get(key), dict):
            yield node[key], f"{path}/{key}"


def _negated(path: str) -> bool:
    """True for a subschema whose refusals the schema accepts (`not`, an `if` that chooses
    `else`): the stricter rewrites would widen the schema there, so they stay out."""
    return path.endswith(("/not", "/if"))


def normalize_json_schema(
    schema: dict[str, Any] | bool,
    *,
    disable_additional_properties: bool = False,
    one_of_as_any_of: bool = False,
) -> dict[str, Any] | bool:
    """Returns a copy of `schema` in the form every backend reads (see the module docstring).

    With `disable_additional_properties`, object schemas get `additionalProperties: false`
    unless they set it. Raises GrammarCompileError naming the location when no value can
    satisfy the schema, and UnsupportedConstraintError for a `oneOf` whose branches may
    overlap (unless `one_of_as_any_of`).
    """
    if schema is False:
        raise GrammarCompileError(_FIELD, "the schema `false` accepts no value")
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise GrammarCompileError(
            _FIELD, f"a schema must be a JSON object, got {type(schema).__name__}"
        )
    out = copy.deepcopy(schema)
    draft = out.get("$schema") if isinstance(out.get("$schema"), str) else ""
    _apply_draft(out, bool(_LEGACY_REF_DRAFTS.search(draft)))
    drop_unreferenced_definitions(out)
    _normalize_node(out, out, "#", disable_additional_properties, one_of_as_any_of)
    # The result is written in 2020-12's keywords (prefixItems, dependentRequired...), and
    # llguidance reads a schema by its `$schema`: a draft-07 label would hide them.
    out["$schema"] = DRAFT_2020_12
    return out


def _apply_draft(node: Any, legacy: bool) -> None:
    """Rewrites, in place and in every subschema, the draft-specific forms into 2020-12's
    (before any rewrite moves subschemas between nodes)."""
    if not isinstance(node, dict):
        return
    if legacy and "$ref" in node:
        # Before 2019-09 a `$ref` replaces its whole schema object; definitions stay only
        # because refs elsewhere may point into them.
        for key in [k for k in node if k not in ("$ref", "$defs", "definitions")]:
            del node[key]
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(node.get(exclusive), bool):  # draft-04's form
            if node.pop(exclusive) and bound in node:
                node[exclusive] = node.pop(bound)
    if isinstance(node.get("items"), list):
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    if isinstance(node.get("format"), str) and node["format"] not in _KNOWN_FORMATS:
        del node["format"]  # an annotation only (JSON Schema 2020-12, section 7.2.1)
    for sub, _ in _subschemas(node, "#"):
        _apply_draft(sub, legacy)


def _normalize_node(
    node: Any, root: dict[str, Any], path: str, no_extra: bool, coerce: bool
) -> None:
    if not isinstance(node, dict):
        return
    _check_shapes(node, path)
    try:
        _rewrite_node(node, root, path, no_extra, coerce)
    except RecursiveIntersection as e:
        raise UnsupportedConstraintError(
            _FIELD,
            f"at {path}: the schemas {e.refs[0]!r} and {e.refs[1]!r} would be intersected "
            "inside their own intersection ('allOf', or keywords beside 'anyOf'/'oneOf', "
            "over recursive definitions): the result has no end, so no backend can enforce "
            "it; write the combined definition out once instead",
        ) from None
    check_satisfiable(node, path)
    for sub, sub_path in _subschemas(node, path):
        if not _negated(sub_path):
            _normalize_node(sub, root, sub_path, no_extra, coerce)


# Keywords the rewrites read, and the JSON type their value must have.
_SHAPES = {
    "allOf": (list, "an array"), "anyOf": (list, "an array"), "oneOf": (list, "an array"),
    "prefixItems": (list, "an array"), "required": (list, "an array"),
    "enum": (list, "an array"), "properties": (dict, "an object"),
    "patternProperties": (dict, "an object"), "$defs": (dict, "an object"),
    "definitions": (dict, "an object"), "type": ((str, list), "a string or an array"),
}


def _check_shapes(node: dict[str, Any], path: str) -> None:
    """Raises GrammarCompileError naming the keyword whose value has the wrong JSON type."""
    for key, (shape, name) in _SHAPES.items():
        if key in node and not isinstance(node[key], shape):
            raise GrammarCompileError(_FIELD, f"at {path}: {key!r} must be {name}")
    for key in ("required", "type"):
        if isinstance(node.get(key), list) and not all(isinstance(v, str) for v in node[key]):
            raise GrammarCompileError(_FIELD, f"at {path}: {key!r} must list strings")


def _drop_closed_names(node: dict[str, Any]) -> None:
    """Removes listed properties with the schema false from a closed object without
    patternProperties: they may not appear either way, and xgrammar refuses `false`."""
    props = node.get("properties")
    if node.get("additionalProperties") is not False or node.get("patternProperties"):
        return
    if isinstance(props, dict):
        for name in [n for n, sub in props.items() if sub is False]:
            del props[name]


def _rewrite_node(
    node: dict[str, Any], root: dict[str, Any], path: str, no_extra: bool, coerce: bool
) -> None:
    """Every rewrite of one node, in the order they depend on each other."""
    _rewrite_unevaluated_properties(node, root)  # reads the `allOf` members as they are
    conditions = merge_all_of(node, root, path)
    _rewrite_dependencies(node)
    _rewrite_not(node, root)
    _rewrite_conditionals(node, root, [*conditions, *pop_conditions(node)])
    _rewrite_property_names(node)
    _rewrite_min_properties(node)
    _rewrite_contains(node, root)
    _narrow_unique_items(node)
    if isinstance(node.get("oneOf"), list) and node["oneOf"]:
        rewrite_one_of(node, root, path, coerce)
    merge_all_of(node, root, path, conditions=False)  # the rules the rewrites added
    if no_extra and "additionalProperties" not in node:
        if node.get("type") == "object" or "properties" in node:
            node["additionalProperties"] = False
    distribute_any_of(node, root)
    _drop_closed_names(node)


def _narrow_unique_items(node: dict[str, Any]) -> None:
    """Enforces `uniqueItems: true` by allowing at most one item, when the schema allows that.

    No grammar can say "all items differ"; an array of at most one item always satisfies it.
    An array that must hold two or more items is left as is, for the backends to refuse.
    """
    if node.get("uniqueItems") is not True:
        return
    low = node.get("minItems", 0)
    if is_number(low) and low > 1:
        return
    del node["uniqueItems"]
    high = node.get("maxItems")
    node["maxItems"] = min(high, 1) if is_number(high) else 1


def _rewrite_property_names(node: dict[str, Any]) -> None:
    """`propertyNames` that is a pattern or a length range becomes the equivalent
    `patternProperties` plus `additionalProperties: false`, which the backends enforce.

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
    if names.get("type", "string") != "string" or keys - {"type", "pattern", "minLength",
                                                           "maxLength"}:
        return
    low, high = names.get("minLength"), names.get("maxLength")
    if "pattern" in names:
        if low is not None or high is not None or not isinstance(names["pattern"], str):
            return  # a pattern and a length cannot be one regex without lookarounds
        regex = names["pattern"]
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


def _rewrite_min_properties(node: dict[str, Any]) -> None:
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
    for sub, sub_path in _subschemas(schema, "#"):
        if not _negated(sub_path):
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


def _rewrite_unevaluated_properties(node: dict[str, Any], root: dict[str, Any]) -> None:
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


def _rewrite_contains(node: dict[str, Any], root: dict[str, Any]) -> None:
    """`contains` (with `minContains` m, default 1) becomes m leading items that match it.
    With `maxContains`, the items after them must not match it, which is written when the
    item schema lists the values of the properties `contains` pins. Stricter than `contains`
    (the matches come first, and exactly m of them with `maxContains`), never wrong."""
    wanted = node.get("contains")
    if wanted is None or "prefixItems" in node:
        return
    low = node.get("minContains", 1)
    high = node.get("maxContains")
    if not isinstance(low, int) or isinstance(low, bool) or not 1 <= low <= 8:
        return
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
    node["prefixItems"] = [copy.deepcopy(match) for _ in range(low)]
    node["items"] = rest
    node["minItems"] = max(node.get("minItems", 0), low)


def _absent(names: list[str]) -> dict[str, Any]:
    """A schema an object matches when one of `names` is missing (non-objects match too)."""
    if len(names) == 1:
        return {"properties": {names[0]: False}}
    return {"anyOf": [{"properties": {name: False}} for name in names]}


def _rewrite_dependencies(node: dict[str, Any]) -> None:
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


def _rewrite_not(node: dict[str, Any], root: dict[str, Any]) -> None:
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


def _rewrite_conditionals(
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
        return UnsupportedConstraintError(_FIELD, f"at {path}: {why} (unsupported by xgrammar)")

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
    if "minLength" in node or "maxLength" in node:
        for key in ("pattern", "format"):
            if key in node:
                raise bad(f"{key!r} combined with minLength/maxLength is not supported")
    for sub, sub_path in _subschemas(node, path):
        _check_xgrammar_node(sub, sub_path)


