"""The engine's declared narrowings, each checked mechanically (README, "Valid but refused").

The engine's structured outputs are closed-world by design: a backend may refuse a value
`jsonschema` accepts, but only by one of the narrowings it declares. `Explainer.explain`
names the narrowing that refuses such a value, or returns "" (an unexplained refusal: a
finding of the differential check). A refused value is explained when

- **token spelling**: the grammar wrote it itself (a random walk), in tokens other than the
  tokenizer's own encoding of its text, which holds a token the backend never allows (on
  lm-format-enforcer, a piece of a character); or
- **number spelling**: the grammar accepts the same JSON value written another way (an
  integral float without its `.0`, a fraction with trailing zeros); or
- `jsonschema` refuses it (its integral floats written as integers) under the schema with one
  of the backend's narrowings applied (`narrowed`), the schema first spelled in 2020-12's
  keywords (`as_2020_12`), and the narrowing applied only where it narrows (never inside
  `not` or `if`):
  - **closed objects** / **closed arrays**: every value position gets
    `unevaluatedProperties: false` / `unevaluatedItems: false`: no property or item the
    schema does not list (its `properties`, `patternProperties`, `additionalProperties`,
    `prefixItems`, `items`, through `$ref` and the combinators);
  - **unique items**: `uniqueItems: true` by schema/unique.py's stricter rule: at most one
    item when `minItems` <= 1; else listed values (`enum`, `const`, booleans) in the list's
    order, or exactly `minItems` strings whose first characters fall in successive ranges;
  - **contains first**: the `minContains` (default 1) items right after `prefixItems` match
    `contains`, and with `maxContains` no later item does;
  - **at most 20 items** (lm-format-enforcer): an array with `items` and no `maxItems`
    holds at most 20 (the library's cap);
  - **minProperties as a listed property** (llguidance): `minProperties: 1` beside
    `properties` is met by one of the listed properties (rewrites.spell_out_min_properties);
  - **non-integer branch dropped** (xgrammar, llguidance): the value passes the engine's
    reading of the schema but not once its `anyOf` branches of numbers that are not
    integers (a `oneOf` of `integer` and `number`, `not` of `integer`) are dropped where
    another branch remains: what a backend without a rule for them does
    (`drop_fraction_branches`; xgrammar's rule takes no bounds);
  - **format spelling**: each `format` as the backend spells it (its own grammar for
    `{"type": "string", "format": F}` accepts the string; on xgrammar, `hostname`,
    `uri-reference` and `uri-template` beside a length bound are one DNS label, or
    characters that need no structure: `BOUNDED_FORMATS`); or
- **oneOf made exclusive**: the same backend accepts it with every `oneOf` read as `anyOf`
  (`one_of_as_any_of`), or with each `oneOf` over the whole value replaced by the one branch
  the value matches (`matched_branches`): the refusal comes from how overlapping branches were made
  exclusive, where a branch keeps only part of what the others refuse (schema/one_of.py:
  "does not match a pattern or a format" has no schema).

The narrowings each backend declares are `NARROWINGS` (its module docstring says which).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema

from tests.v1.structured_output.oracle import _exact_multiple_of
from vllm.v1.structured_output.schema.unique import MAX_BINS, first_character_bins

CLOSED_OBJECTS = "closed objects"
CLOSED_ARRAYS = "closed arrays"
UNIQUE_ITEMS = "unique items"
CONTAINS_FIRST = "contains first"
FORMAT_SPELLING = "format spelling"
LISTED_PROPERTY = "minProperties as a listed property"
FRACTION_BRANCH = "non-integer branch dropped"
ITEM_CAP = "at most 20 items"
NUMBER_SPELLING = "number spelling"
TOKEN_SPELLING = "token spelling"
ONE_OF_EXCLUSIVE = "oneOf made exclusive"

NARROWINGS: dict[str, tuple[str, ...]] = {
    "xgrammar": (CLOSED_OBJECTS, CLOSED_ARRAYS, UNIQUE_ITEMS, CONTAINS_FIRST, FORMAT_SPELLING,
                 FRACTION_BRANCH),
    "guidance": (UNIQUE_ITEMS, CONTAINS_FIRST, FORMAT_SPELLING, LISTED_PROPERTY,
                 FRACTION_BRANCH),
    "outlines": (CLOSED_OBJECTS, CLOSED_ARRAYS, UNIQUE_ITEMS, CONTAINS_FIRST, FORMAT_SPELLING),
    "lm-format-enforcer": (CLOSED_OBJECTS, UNIQUE_ITEMS, CONTAINS_FIRST, ITEM_CAP),
}

# Keywords whose value is one subschema, an object of subschemas, or a list of them.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not",
        "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
# xgrammar's formats beside `minLength`/`maxLength` (schema/lengths.py): one DNS label, a
# relative path or a template of literal characters.
BOUNDED_FORMATS = {
    "hostname": "[a-z0-9]{1,63}",
    "uri-reference": "[A-Za-z0-9._~!$&'*+,;=/()-]*",
    "uri-template": "[A-Za-z0-9._~!$&*+,;=/:?@#()-]*",
}
# Keywords later drafts added, by the draft that lacks them (its validators ignore them).
_NEWER = {"draft-07": ("dependentRequired", "dependentSchemas", "minContains", "maxContains",
                       "unevaluatedProperties", "unevaluatedItems", "prefixItems")}
_NEWER["draft-06"] = ("if", "then", "else", *_NEWER["draft-07"])
_NEWER["draft-04"] = ("const", "contains", "propertyNames", *_NEWER["draft-06"])
# Where a subschema describes a value of its own (a property, an item), not its node's.
_POSITIONS = ("additionalProperties", "items", "contains", "properties", "patternProperties",
              "prefixItems")


def _children(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(keyword, subschema) for every direct subschema of `node`."""
    for key in _ONE:
        if key in node:
            yield key, node[key]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            yield from ((key, sub) for sub in node[key].values())
    for key in _LIST:
        if isinstance(node.get(key), list):
            yield from ((key, sub) for sub in node[key])


def as_2020_12(schema: Any) -> Any:
    """A copy of `schema` in 2020-12's keywords with the meaning of its own `$schema` draft:
    before 2019-09 a `$ref` ignores its siblings; keywords of later drafts are dropped;
    draft-04's boolean exclusive bounds become numbers; list-form `items` becomes
    `prefixItems` (and `additionalItems` `items`); `dependencies` becomes
    `dependentRequired`/`dependentSchemas`."""
    draft = schema.get("$schema", "") if isinstance(schema, dict) else ""
    legacy = bool(re.search(r"draft-0[3-7]", draft))
    named = re.search(r"draft-0[4-7]", draft)
    out = _convert(copy.deepcopy(schema), legacy, named[0] if named else "")
    if isinstance(out, dict):
        out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return out


def _convert(node: Any, legacy: bool, draft: str) -> Any:
    if not isinstance(node, dict):
        return node
    if legacy and "$ref" in node:
        for key in [k for k in node if k not in ("$ref", "$defs", "definitions")]:
            del node[key]
    for key in _NEWER.get(draft, ()):
        node.pop(key, None)  # not a keyword of the schema's draft: an unknown word, ignored
    if draft == "draft-04":
        for bound, exclusive in (("minimum", "exclusiveMinimum"),
                                 ("maximum", "exclusiveMaximum")):
            if isinstance(node.get(exclusive), bool) and node.pop(exclusive) and bound in node:
                node[exclusive] = node.pop(bound)
    if isinstance(node.get("items"), list):
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    node.pop("additionalItems", None)  # ignored beside a single `items` schema
    if isinstance(node.get("dependencies"), dict):
        for name, need in node.pop("dependencies").items():
            key = "dependentRequired" if isinstance(need, list) else "dependentSchemas"
            node.setdefault(key, {})[name] = need
    for key, sub in list(_children(node)):
        _convert(sub, legacy, draft)
    return node


def narrowed(schema: Any, names: tuple[str, ...]) -> Any:
    """A copy of the 2020-12 `schema` with the narrowings `names` applied where they narrow:
    everywhere but inside `not` and `if` (where narrowing would widen or change the schema).
    Uniqueness, `contains` and formats are marked with `x-` keywords `validator` reads."""
    out = copy.deepcopy(schema)
    _narrow(out, set(names), position=True)
    return out


def _narrow(node: Any, names: set[str], position: bool) -> None:
    if not isinstance(node, dict):
        return
    if position and CLOSED_OBJECTS in names:
        node.setdefault("unevaluatedProperties", False)
    if position and CLOSED_ARRAYS in names:
        node.setdefault("unevaluatedItems", False)
    if UNIQUE_ITEMS in names and node.get("uniqueItems") is True:
        node["x-uniqueItems"] = True
    if CONTAINS_FIRST in names and "contains" in node:
        node["x-containsFirst"] = True
    if FORMAT_SPELLING in names and isinstance(node.get("format"), str):
        node["x-format"] = node["format"]
    if ITEM_CAP in names and "items" in node and "maxItems" not in node:
        node["maxItems"] = 20
    listed = node.get("properties")
    if LISTED_PROPERTY in names and node.get("minProperties") == 1 and isinstance(
            listed, dict) and listed:
        node["x-listedProperty"] = list(listed)
    for key, sub in list(_children(node)):
        if key not in ("not", "if", "propertyNames"):
            _narrow(sub, names, key in _POSITIONS)


def _resolve(validator: Any, schema: Any) -> Any:
    # jsonschema's `referencing` resolver (the public `resolver` is deprecated).
    for _ in range(8):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            break
        schema = validator._resolver.lookup(schema["$ref"]).contents
    return schema


def _listed(schema: Any) -> list[Any] | None:
    """The values an item schema lists (`const`, `enum`, booleans), in its order."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return schema["enum"]
    if schema.get("type") == "boolean":
        return [False, True]
    return None


def _strict_unique(validator: Any, on: Any, instance: Any, schema: dict[str, Any]) -> Any:
    """schema/unique.py's rule for `uniqueItems: true` (see the module docstring)."""
    if not on or not validator.is_type(instance, "array") or len(instance) <= 1:
        return
    low = schema.get("minItems", 0)
    if low <= 1:
        yield jsonschema.ValidationError("uniqueItems beside minItems <= 1: at most one item")
        return
    if "prefixItems" in schema or "contains" in schema:
        return  # the rule leaves such arrays alone (and the backends refuse them)
    items = _resolve(validator, schema.get("items", True))
    listed = _listed(items)
    if listed is not None:
        places = []
        for item in instance:
            found = [i for i, v in enumerate(listed) if _same(v, item)]
            places.append(found[0] if found else -1)
        if places != sorted(places):
            yield jsonschema.ValidationError("uniqueItems: listed values in the list's order")
        return
    if isinstance(items, dict) and items.get("type") == "string" and low <= MAX_BINS:
        bins = first_character_bins(int(low))
        if len(instance) != low or not all(
            isinstance(s, str) and re.match(b, s) for b, s in zip(bins, instance)
        ):
            yield jsonschema.ValidationError(
                "uniqueItems: minItems strings in ascending first-character ranges")


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True) or (
        _is_number(a) and _is_number(b) and a == b)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _contains_first(validator: Any, on: Any, instance: Any, schema: dict[str, Any]) -> Any:
    """The rewrite of `contains` (schema/rewrites.py): its matches come first."""
    if not on or not validator.is_type(instance, "array"):
        return
    low = schema.get("minContains", 1)
    if not isinstance(low, int) or not 1 <= low <= 8:
        return
    start = len(schema.get("prefixItems", []))
    wanted = schema["contains"]
    lead = instance[start:start + low]
    if len(lead) < low or not all(validator.evolve(schema=wanted).is_valid(i) for i in lead):
        yield jsonschema.ValidationError(f"contains: the {low} items after the listed ones")
    if "maxContains" in schema and any(
        validator.evolve(schema=wanted).is_valid(i) for i in instance[start + low:]
    ):
        yield jsonschema.ValidationError("maxContains: no match after the leading ones")


def _listed_property(validator: Any, names: Any, instance: Any, schema: Any) -> Any:
    """llguidance's `minProperties: 1` (rewrites.spell_out_min_properties)."""
    if validator.is_type(instance, "object") and not any(n in instance for n in names):
        yield jsonschema.ValidationError(f"minProperties 1: none of {names} is present")


def validator(schema: Any, format_ok: Callable[[str, str], bool] | None,
              format_checker: Any = None, draft04: bool = False, bounded: bool = False) -> Any:
    """A 2020-12 validator of `schema` (exact decimal `multipleOf`; with `draft04`, 1.0 is
    no integer, as in draft-04) that also reads the marks `narrowed` writes;
    `format_ok(format, string)` decides `x-format`, and with `bounded` a format beside a
    length bound is also spelled by `BOUNDED_FORMATS`."""
    return validator_class(format_ok, draft04, bounded)(schema, format_checker=format_checker)


@functools.lru_cache(maxsize=64)
def validator_class(format_ok: Callable[[str, str], bool] | None, draft04: bool = False,
                    bounded: bool = False) -> Any:
    """The validator class of `validator` (build it once and reuse it: a class costs a
    millisecond)."""

    def backend_format(validator: Any, fmt: Any, instance: Any, schema: Any) -> Any:
        if not isinstance(instance, str) or format_ok is None:
            return
        spelled = BOUNDED_FORMATS.get(fmt) if bounded and (
            "minLength" in schema or "maxLength" in schema) else None
        if not format_ok(fmt, instance) or (
                spelled is not None and not re.fullmatch(spelled, instance)):
            yield jsonschema.ValidationError(f"{instance!r} is not {fmt} as the backend writes it")

    cls = jsonschema.validators.extend(jsonschema.Draft202012Validator, {
        "multipleOf": _exact_multiple_of, "x-uniqueItems": _strict_unique,
        "x-containsFirst": _contains_first, "x-format": backend_format,
        "x-listedProperty": _listed_property,
    }, type_checker=(jsonschema.Draft4Validator.TYPE_CHECKER if draft04
                     else jsonschema.Draft202012Validator.TYPE_CHECKER))
    return cls


def one_of_as_any_of(schema: Any) -> Any:
    """A copy of `schema` with every `oneOf` read as `anyOf` (beside an `anyOf` of its own,
    both under an `allOf`)."""
    if isinstance(schema, list):
        return [one_of_as_any_of(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: one_of_as_any_of(v) for k, v in schema.items()}
    if isinstance(out.get("oneOf"), list):
        branches = out.pop("oneOf")
        if "anyOf" in out:
            out.setdefault("allOf", []).append({"anyOf": branches})
        else:
            out["anyOf"] = branches
    return out


def _needs_fraction_branch(value: Any, schema: dict[str, Any]) -> bool:
    """Whether `value` passes the engine's reading of `schema` (`normalize_json_schema`)
    but not once its branches of numbers that are not integers are dropped where another
    branch remains (`drop_fraction_branches`, done where the backend has no rule for them)."""
    from vllm.exceptions import InvalidRequestError
    from vllm.v1.structured_output.schema.facts import drop_fraction_branches
    from vllm.v1.structured_output.schema.normalize import normalize_json_schema

    try:
        read = normalize_json_schema(schema)
    except InvalidRequestError:
        return False  # refused: no backend reads it
    if '"not"' not in json.dumps(read):
        return False
    dropped = copy.deepcopy(read)
    drop_fraction_branches(dropped)
    try:
        return validator(read, None).is_valid(value) and not validator(
            dropped, None).is_valid(value)
    except (ArithmeticError, ValueError):
        return False


def matched_branches(schema: dict[str, Any], value: Any,
                     is_valid: Callable[[Any, Any], bool]) -> dict[str, Any] | None:
    """`schema` with each `oneOf` that applies to the whole value (reached through `allOf`,
    `anyOf` and `oneOf` from the root) replaced by the one branch that makes `value` valid
    (its other keywords kept), where exactly one does; None when none was replaced."""
    out, changed, skipped = copy.deepcopy(schema), False, set()
    for _ in range(16):
        path = next((p for p in _in_place_one_ofs(out, ()) if p not in skipped), None)
        if path is None:
            break
        candidates = []
        for i in range(len(_at(out, path)["oneOf"])):
            candidate = copy.deepcopy(out)
            node = _at(candidate, path)
            node.setdefault("allOf", []).append(node.pop("oneOf")[i])
            if is_valid(value, candidate):
                candidates.append(candidate)
        if len(candidates) == 1:
            out, changed = candidates[0], True
        else:
            skipped.add(path)
    return out if changed else None


def _in_place_one_ofs(node: Any, path: tuple) -> Iterator[tuple]:
    if not isinstance(node, dict):
        return
    if isinstance(node.get("oneOf"), list):
        yield path
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _in_place_one_ofs(sub, path + (key, i))


def _at(node: Any, path: tuple) -> Any:
    for step in path:
        node = node[step]
    return node


def integral(value: Any) -> Any:
    """`value` with its integral floats as integers (the same JSON values)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [integral(v) for v in value]
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    return value


def spellings(text: str) -> list[str]:
    """Other compact spellings of the JSON text `text`: its fractions with trailing zeros to
    2-6 digits (a backend may write `multipleOf: 0.25` with exactly two), integral floats
    without their `.0`."""
    out = []
    for digits in range(2, 7):
        out.append(re.sub(r"(?<![\w.])(-?\d+)\.(\d+)(?![\d.eE])",
                          lambda m: f"{m[1]}.{m[2].ljust(digits, '0')}", text))
    out.append(re.sub(r"(?<![\w.])(-?\d+)\.0(?![\d.eE])", r"\1", text))
    return [s for s in dict.fromkeys(out) if s != text]


class Explainer:
    """Names the declared narrowing by which one backend refuses a valid value."""

    def __init__(self, backend: str, format_ok: Callable[[str, str], bool],
                 format_checker: Any = None) -> None:
        self.names = NARROWINGS.get(backend, ())
        self.bounded_formats = backend == "xgrammar"
        self.format_ok = format_ok
        self.format_checker = format_checker
        self._draft04 = False
        self._classes = {d: validator_class(format_ok, d, self.bounded_formats)
                         for d in (False, True)}

    def _valid(self, value: Any, schema: Any, names: tuple[str, ...]) -> bool:
        cls = self._classes[self._draft04]
        check = cls(narrowed(schema, names), format_checker=self.format_checker)
        try:
            return check.is_valid(value)
        except (ArithmeticError, ValueError):
            return True  # no exact verdict: nothing proven

    def explain(self, value: Any, text: str, schema: dict[str, Any],
                accepts: Callable[[str], bool], is_valid: Callable[[Any, Any], bool],
                accepts_schema: Callable[[Any, str], bool] | None = None) -> str:
        """The narrowing that refuses `value` (whose compact text the grammar refused), or ""
        when none does. `accepts` is the grammar's verdict on a text, `is_valid(value, schema)`
        jsonschema's under the schema's own draft, `accepts_schema(other, text)` the same
        backend's verdict on a text for another schema (None: no `oneOf` proof). Raises
        AssertionError when the 2020-12 spelling of `schema` refuses the value its own draft
        accepts (a checker bug)."""
        texts = [text, *spellings(text)]
        if any(accepts(s) for s in texts[1:]):
            return NUMBER_SPELLING
        plain = integral(value)
        if not is_valid(plain, schema):
            plain = value  # draft-04: 1.0 is no integer, so the respelling changed the value
        self._draft04 = "draft-04" in str(schema.get("$schema", ""))
        converted = as_2020_12(schema)
        assert self._valid(plain, converted, ()), (schema, value)
        for name in self.names:
            if not self._valid(plain, converted, (name,)):
                return name
        if len(self.names) > 1 and not self._valid(plain, converted, self.names):
            return "+".join(self.names)
        if FRACTION_BRANCH in self.names and _needs_fraction_branch(plain, schema):
            return FRACTION_BRANCH
        if accepts_schema is not None and '"oneOf"' in json.dumps(schema):
            # Valid, so one `oneOf` branch alone matches: the refusal comes from how the
            # branches were made exclusive when the same value passes without that.
            loose = [one_of_as_any_of(schema), matched_branches(schema, value, is_valid)]
            if any(other is not None and accepts_schema(other, t)
                   for other in loose for t in texts):
                return ONE_OF_EXCLUSIVE
        return ""
