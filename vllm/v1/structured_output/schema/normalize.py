"""JSON-schema preparation shared by the backends: the schema's own draft semantics, exact
`oneOf`, and refusals of what a backend would not enforce (docs/architecture.md section 5).

- `normalize_json_schema` (every backend): returns a copy in the form the backends read, with
  the semantics of the schema's `$schema` draft made explicit (default 2020-12): before
  2019-09 the keywords beside a `$ref` are ignored, so they are dropped, and so are the
  assertions of drafts later than the schema's own (draft-04's `const`, `contains`,
  `propertyNames`; draft-06's `if`; draft-07's `prefixItems`...); draft-04's boolean
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
    branches stay as they are, overlapping ones each keep what the others refuse. "A number
    that is not an integer" (`integer` beside `number`) is written `{type: number, not:
    {type: integer}}` (`fraction_schema`): the xgrammar backend enforces it by a rule of its
    own (schema_xgrammar.py), and a backend without one drops such `anyOf` branches where
    another remains (`drop_fraction_branches`, narrower) or refuses them by place. No backend
    enforces "exactly one"; a `oneOf` that cannot be made exclusive is refused naming two
    branches, unless the server treats `oneOf` as `anyOf` by choice (`one_of_as_any_of`);
  - (schema_rewrites.py) `dependencies`/`dependentRequired`/`dependentSchemas` become
    `allOf` rules;
    `propertyNames` (a pattern or a length) becomes `patternProperties`;
    `unevaluatedProperties` beside an `allOf` of plain objects becomes
    `additionalProperties`.
  Stricter rules that never admit an invalid value: `uniqueItems: true` allows at most one
  item, or distinct listed values in order, or strings in ascending first-character ranges
  (schema_unique.py; no grammar can express "all items differ"), `contains` puts its matches
  first, an overlapping `oneOf` branch whose exact remainder has no schema or too many
  alternatives keeps part of it, and, for llguidance,
  `minProperties: 1` (`spell_out_min_properties`). None of these run inside `not` or `if`,
  where narrowing would widen the schema. A `format` no backend knows is an annotation, as
  the JSON Schema specification says, and is dropped. The result is labelled 2020-12, the
  draft its keywords are written in. Schemas no value can satisfy, and keywords of the wrong
  JSON type, are refused.
- `check_xgrammar_support` (schema_xgrammar.py): raises UnsupportedConstraintError at the
  first keyword xgrammar 0.2.9 accepts but does not enforce (so an output could violate the
  schema), or refuses wrongly (a property with the schema `false`); the `auto` backend then
  tries llguidance.

Pure Python that imports neither xgrammar nor numpy.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from typing import Any

from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.v1.structured_output.schema.facts import (
    FIELD as _FIELD,
)
from vllm.v1.structured_output.schema.facts import (
    check_satisfiable,
    is_negated,
    subschemas,
)
from vllm.v1.structured_output.schema.for_xgrammar import KNOWN_FORMATS, check_xgrammar_support
from vllm.v1.structured_output.schema.merge import (
    RecursiveIntersection,
    distribute_any_of,
    merge_all_of,
    pop_conditions,
)
from vllm.v1.structured_output.schema.one_of import rewrite_one_of
from vllm.v1.structured_output.schema.patterns import rewrite_anchors, rewrite_lookarounds
from vllm.v1.structured_output.schema.refs import drop_unreferenced_definitions
from vllm.v1.structured_output.schema.rewrites import (
    fold_enums,
    rewrite_conditionals,
    rewrite_contains,
    rewrite_dependencies,
    rewrite_min_properties,
    rewrite_not,
    rewrite_property_names,
    rewrite_unevaluated_properties,
    spell_out_min_properties,
)
from vllm.v1.structured_output.schema.unique import rewrite_unique_items

# What the backends import from here.
__all__ = ["DRAFT_2020_12", "check_xgrammar_support", "normalize_json_schema",
           "spell_out_min_properties"]

DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"


# `$schema` values of the drafts in which keywords beside `$ref` are ignored.
_LEGACY_REF_DRAFTS = re.compile(r"draft-0[3-7]")
# The assertions later drafts added, by the draft that lacks them: an older draft's
# validators ignore them (unknown words), so they are dropped too (draft-04's
# `propertyNames` was enforced here, jsonschema ignores it; found by the differential check).
_LATER_KEYWORDS = {
    "draft-07": ("dependentRequired", "dependentSchemas", "minContains", "maxContains",
                 "unevaluatedProperties", "unevaluatedItems", "prefixItems"),
}
_LATER_KEYWORDS["draft-06"] = ("if", "then", "else", *_LATER_KEYWORDS["draft-07"])
_LATER_KEYWORDS["draft-04"] = ("const", "contains", "propertyNames",
                               *_LATER_KEYWORDS["draft-06"])
_DRAFT_NAME = re.compile(r"draft-0[4-7]")


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

    Normalized schemas are remembered by their JSON text (the most recent few hundred): a
    request's schema is normalized by its admission check and again by its backend, and
    clients send the same schemas again and again.
    """
    if isinstance(schema, dict):
        try:
            text = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError):  # not plain JSON: normalized as it is
            return _normalize(schema, disable_additional_properties, one_of_as_any_of)
        # A copy each time: callers may edit what they get.
        return copy.deepcopy(_normalized(text, disable_additional_properties,
                                         one_of_as_any_of))
    return _normalize(schema, disable_additional_properties, one_of_as_any_of)


@functools.lru_cache(maxsize=256)
def _normalized(text: str, disable_additional_properties: bool,
                one_of_as_any_of: bool) -> dict[str, Any] | bool:
    """The normalized schema of a schema's JSON text (see normalize_json_schema; errors are
    raised, never remembered). Shared: never handed out without a copy."""
    return _normalize(json.loads(text), disable_additional_properties, one_of_as_any_of)


def _normalize(schema: Any, disable_additional_properties: bool,
               one_of_as_any_of: bool) -> dict[str, Any] | bool:
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
    named = _DRAFT_NAME.search(draft)
    _apply_draft(out, bool(_LEGACY_REF_DRAFTS.search(draft)),
                 _LATER_KEYWORDS.get(named[0] if named else "", ()))
    drop_unreferenced_definitions(out)
    _normalize_node(out, out, "#", disable_additional_properties, one_of_as_any_of)
    fold_enums(out, out)
    if isinstance(out, dict) and out.get("enum") == []:
        raise GrammarCompileError(_FIELD, "no value satisfies the schema ('enum' beside the "
                                  "keywords that refuse each of its values)")
    # The result is written in 2020-12's keywords (prefixItems, dependentRequired...), and
    # llguidance reads a schema by its `$schema`: a draft-07 label would hide them.
    out["$schema"] = DRAFT_2020_12
    return out


def _apply_draft(node: Any, legacy: bool, later: tuple[str, ...]) -> None:
    """Rewrites, in place and in every subschema, the draft-specific forms into 2020-12's
    (before any rewrite moves subschemas between nodes), dropping the keywords `later`
    (assertions of later drafts, unknown to the schema's own)."""
    if not isinstance(node, dict):
        return
    for key in later:
        node.pop(key, None)
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
    if isinstance(node.get("format"), str) and node["format"] not in KNOWN_FORMATS:
        del node["format"]  # an annotation only (JSON Schema 2020-12, section 7.2.1)
    for sub, _ in subschemas(node, "#"):
        _apply_draft(sub, legacy, later)


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
    for sub, sub_path in subschemas(node, path):
        if not is_negated(node, sub):
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


def _check_counted_keys(node: dict[str, Any], path: str) -> None:
    """Refuses `minProperties` that keys no `properties` lists must help reach: a grammar
    cannot keep such a key from repeating, and JSON keeps the last of repeated keys
    (`{"b": 1, "b": 2}` passed `minProperties: 2` on xgrammar and llguidance)."""
    low = node.get("minProperties")
    if not isinstance(low, int) or isinstance(low, bool) or low < 2:
        return
    high = node.get("maxProperties")
    if isinstance(high, int) and high < low:
        return  # no value at all, which the satisfiability check names
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = [n for n in node.get("required", []) if n in listed]
    open_keys = "patternProperties" in node or node.get("additionalProperties", True) is not False
    if open_keys and len(set(required)) < low:
        raise UnsupportedConstraintError(
            _FIELD, f"at {path}: 'minProperties' {low} counted over unlisted keys, which a "
            "grammar cannot keep from repeating")


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
    rewrite_lookarounds(node)
    rewrite_anchors(node, path)
    rewrite_unevaluated_properties(node, root)  # reads the `allOf` members as they are
    conditions = merge_all_of(node, root, path)
    rewrite_dependencies(node)
    rewrite_not(node, root)
    rewrite_conditionals(node, root, [*conditions, *pop_conditions(node)])
    rewrite_property_names(node)
    rewrite_min_properties(node)
    rewrite_contains(node, root)
    rewrite_unique_items(node, root)
    if isinstance(node.get("oneOf"), list) and node["oneOf"]:
        rewrite_one_of(node, root, path, coerce)
    merge_all_of(node, root, path, conditions=False)  # the rules the rewrites added
    if no_extra and "additionalProperties" not in node:
        if node.get("type") == "object" or "properties" in node:
            node["additionalProperties"] = False
    distribute_any_of(node, root)
    _drop_closed_names(node)
    _check_counted_keys(node, path)


