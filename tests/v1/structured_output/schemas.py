"""A corpus of constraints and independent checks of outputs against them.

Every case is bounded (maxLength, maxItems, enums, small ranges) so a random walk over the
allowed tokens finishes. Engine-level tests reuse `ALL_CASES` and `Case.check`: the check
raises AssertionError (or jsonschema.ValidationError) when an output violates the constraint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from vllm.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class Case:
    """One constraint (keyword arguments of StructuredOutputsParams) and its output check."""

    name: str
    params: dict[str, Any]
    check: Callable[[str], None]

    def make_params(self, **options: Any) -> StructuredOutputsParams:
        """Returns fresh StructuredOutputsParams for this case plus `options`."""
        return StructuredOutputsParams(**self.params, **options)


def _s(max_len: int = 8, min_len: int = 0) -> dict[str, Any]:
    return {"type": "string", "minLength": min_len, "maxLength": max_len}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
    }


_POINT = _obj(
    {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9},
    }
)

JSON_SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "flat_person",
        _obj({"name": _s(10), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    ),
    (
        "booleans",
        _obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}}),
    ),
    ("string_enum", _obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}})),
    (
        "nested_address",
        _obj(
            {
                "name": _s(6),
                "address": _obj(
                    {
                        "street": _s(12),
                        "city": _s(8),
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    }
                ),
            }
        ),
    ),
    (
        "int_array",
        _obj(
            {
                "values": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 99},
                    "minItems": 1,
                    "maxItems": 4,
                }
            }
        ),
    ),
    (
        "object_array",
        {
            "type": "array",
            "items": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 9}, "label": _s(4)}),
            "minItems": 1,
            "maxItems": 2,
        },
    ),
    (
        "all_optional",
        _obj(
            {
                "a": {"type": "integer", "minimum": 0, "maximum": 5},
                "b": _s(3),
                "c": {"type": "boolean"},
            },
            required=[],
        ),
    ),
    ("negative_range", _obj({"t": {"type": "integer", "minimum": -50, "maximum": 50}})),
    ("number_unit_range", _obj({"p": {"type": "number", "minimum": 0, "maximum": 1}})),
    (
        "exclusive_ints",
        _obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    ),
    ("zip_pattern", {"type": "string", "pattern": "^[0-9]{5}$"}),
    ("hex_color", _obj({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    (
        "anyof_scalar",
        _obj({"v": {"anyOf": [_s(5), {"type": "integer", "minimum": 0, "maximum": 999}]}}),
    ),
    (
        "anyof_variants",
        {
            "anyOf": [
                _obj(
                    {
                        "kind": {"const": "circle"},
                        "r": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                ),
                _obj(
                    {
                        "kind": {"const": "square"},
                        "side": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                ),
            ]
        },
    ),
    (
        "defs_point",
        {
            "$defs": {"point": _POINT},
            **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        },
    ),
    (
        "defs_nested",
        {
            "$defs": {
                "addr": _obj({"city": _s(6)}),
                "person": _obj({"name": _s(6), "home": {"$ref": "#/$defs/addr"}}),
            },
            **_obj({"owner": {"$ref": "#/$defs/person"}}),
        },
    ),
    (
        "const_fields",
        _obj({"version": {"const": 2}, "kind": {"const": "event"}, "ok": {"const": True}}),
    ),
    (
        "null_field",
        _obj({"nothing": {"type": "null"}, "n": {"type": "integer", "minimum": 0, "maximum": 3}}),
    ),
    ("nullable_int", _obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}})),
    ("mixed_enum", _obj({"e": {"enum": [1, "two", None, True, 3.5]}})),
    (
        "matrix",
        _obj(
            {
                "m": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "array",
                        "maxItems": 3,
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                }
            }
        ),
    ),
    ("bounded_string", _obj({"code": _s(4, min_len=2)})),
    ("uuid_format", _obj({"id": {"type": "string", "format": "uuid"}})),
    (
        "deep_nesting",
        _obj(
            {
                "a": _obj(
                    {"b": _obj({"c": _obj({"d": {"type": "integer", "minimum": 0, "maximum": 9}})})}
                )
            }
        ),
    ),
    (
        "tuple_items",
        {
            "type": "array",
            "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, _s(3)],
            "items": False,
            "minItems": 2,
        },
    ),
    (
        "map_of_ints",
        {
            "type": "object",
            "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
            "propertyNames": {"maxLength": 3},
            "maxProperties": 2,
        },
    ),
    (
        "long_enum",
        _obj(
            {
                "sentence": {
                    "enum": ["the quick brown fox jumps", "over the lazy dog", "hello, world!"]
                }
            }
        ),
    ),
    ("int_from_100", _obj({"n": {"type": "integer", "minimum": 100}})),
    ("unicode_enum", _obj({"city": {"enum": ["Zürich", "東京", "São Paulo", "Kraków"]}})),
    (
        "nested_enum_array",
        _obj(
            {
                "roles": {
                    "type": "array",
                    "items": {"enum": ["admin", "user", "guest"]},
                    "minItems": 1,
                    "maxItems": 3,
                }
            }
        ),
    ),
    (
        "wide_optional",
        _obj(
            {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in "abcdefgh"},
            required=["a", "h"],
        ),
    ),
    (
        "anyof_ref",
        {
            "$defs": {"num": {"type": "integer", "minimum": 0, "maximum": 9}, "word": _s(4)},
            **_obj({"x": {"anyOf": [{"$ref": "#/$defs/num"}, {"$ref": "#/$defs/word"}]}}),
        },
    ),
    (
        "recursive_tree",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer", "minimum": 0, "maximum": 9},
                        "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/node",
        },
    ),
    ("float_range", _obj({"f": {"type": "number", "minimum": -1.5, "maximum": 1.5}})),
    ("int_enum", _obj({"level": {"type": "integer", "enum": [1, 2, 3, 5, 8]}})),
    (
        "fixed_pair",
        _obj(
            {"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}}
        ),
    ),
    ("animal_pattern", _obj({"pet": {"type": "string", "pattern": "^(cat|dog|bird)$"}})),
    (
        "annotated",
        {
            "title": "Item",
            "description": "with annotations",
            **_obj(
                {
                    "sku": {
                        "type": "string",
                        "description": "stock unit",
                        "pattern": "^[A-Z]{3}-[0-9]{3}$",
                    }
                }
            ),
        },
    ),
    ("const_escapes", _obj({"s": {"const": 'a"b\\c\nd'}})),
    (
        "oneof_disjoint",
        _obj(
            {
                "v": {
                    "oneOf": [
                        {"type": "integer", "minimum": 0, "maximum": 9},
                        {"type": "string", "enum": ["none"]},
                    ]
                }
            }
        ),
    ),
    ("allof_single", _obj({"v": {"allOf": [{"type": "integer", "minimum": 1, "maximum": 3}]}})),
    (
        "explicit_closed",
        {
            **_obj({"inner": {**_obj({"k": {"type": "boolean"}}), "additionalProperties": False}}),
            "additionalProperties": False,
        },
    ),
    # Not "^[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5})?$": xgrammar 0.2.9's JSON-string regexes let
    # "Abcdefghij" through (a ranged repeat followed by an optional group with another).
    ("zip_plus4", _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"}})),
    ("empty_props", {"type": "object", "properties": {}}),
    (
        "min_properties",
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "boolean"},
            },
            "minProperties": 1,
        },
    ),
    ("number_array", {"type": "array", "items": {"type": "number"}, "maxItems": 3}),
    ("top_level_int", {"type": "integer", "minimum": 0, "maximum": 1000}),
    ("nullable_string", _obj({"note": {"type": ["string", "null"], "maxLength": 5}})),
]


def _check_json(schema: dict[str, Any]) -> Callable[[str], None]:
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )

    def check(text: str) -> None:
        validator.validate(json.loads(text))

    return check


def _check_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), f"not a JSON object: {text!r}"


REGEXES: list[tuple[str, str]] = [
    ("phone", r"\d{3}-\d{4}"),
    ("email_like", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)"),
    ("ipv4_like", r"(\d{1,3}\.){3}\d{1,3}"),
    ("yes_no", r"(yes|no|maybe)"),
    ("plate", r"[A-Z]{2}[0-9]{2,4}"),
    ("word", r"\w{1,8}"),
    ("decimal", r"-?\d{1,4}(\.\d{1,2})?"),
    ("greek", r"[αβγ]{1,3}"),
    ("repeat_alt", r"(ab|cd){0,4}e"),
    ("date", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
]


def _check_regex(regex: str) -> Callable[[str], None]:
    compiled = re.compile(regex)

    def check(text: str) -> None:
        assert compiled.fullmatch(text), f"{text!r} does not match {regex!r}"

    return check


CHOICES: list[tuple[str, list[str]]] = [
    ("sentiment", ["positive", "negative", "neutral"]),
    ("prefixes", ["a", "ab", "abc"]),
    ("escapes", ['say "hi"', "back\\slash", "new\nline", "tab\there"]),
    ("unicode", ["café", "東京", "🙂 smile"]),
    ("with_empty", ["", "something"]),
    ("numbers", ["1", "10", "100", "1000"]),
]


def _check_choice(choices: list[str]) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert text in choices, f"{text!r} is not one of {choices!r}"

    return check


def _parse_arith(text: str) -> bool:
    """Recognizes expr := term (("+"|"-") term)*, term := factor (("*"|"/") factor)*,
    factor := [0-9]{1,3} | "(" expr ")"."""
    pos = 0

    def factor() -> bool:
        nonlocal pos
        if text[pos : pos + 1] == "(":
            pos += 1
            if not expr() or text[pos : pos + 1] != ")":
                return False
            pos += 1
            return True
        m = re.match(r"[0-9]{1,3}", text[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    def chain(item: Callable[[], bool], ops: str) -> bool:
        nonlocal pos
        if not item():
            return False
        while text[pos : pos + 1] and text[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


def _balanced(text: str) -> bool:
    depth = 0
    for c in text:
        if c not in "()":
            return False
        depth += 1 if c == "(" else -1
        if depth < 0:
            return False
    return depth == 0 and bool(text)


def _check_with(recognize: Callable[[str], bool], what: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert recognize(text), f"{text!r} is not {what}"

    return check


def _check_fullmatch(regex: str, what: str) -> Callable[[str], None]:
    return _check_with(lambda t: re.fullmatch(regex, t) is not None, what)


# EBNF grammars (xgrammar dialect) and Lark grammars, each with an independent recognizer.
GRAMMARS: list[tuple[str, str, Callable[[str], None]]] = [
    (
        "arithmetic",
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
        'factor ::= num | "(" expr ")"\nnum ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]',
        _check_with(_parse_arith, "an arithmetic expression"),
    ),
    (
        "balanced",
        'root ::= "(" inner ")"\ninner ::= ("(" inner ")")*',
        _check_with(_balanced, "balanced"),
    ),
    (
        "key_values",
        'root ::= pair ("," pair)*\npair ::= key "=" val\n'
        'key ::= [a-z] [a-z]? [a-z]?\nval ::= [0-9] [0-9]?',
        _check_fullmatch(r"[a-z]{1,3}=[0-9]{1,2}(,[a-z]{1,3}=[0-9]{1,2})*", "key=value pairs"),
    ),
    (
        "greeting",
        'root ::= ("hello" | "hi") " " name "!"\nname ::= [A-Z] [a-z]{0,8}',
        _check_fullmatch(r"(hello|hi) [A-Z][a-z]{0,8}!", "a greeting"),
    ),
    (
        "logic",
        'root ::= lit ((" and " | " or ") lit)*\nlit ::= "true" | "false" | "not " lit',
        _check_fullmatch(r"(not )*(true|false)(( and | or )(not )*(true|false))*", "a formula"),
    ),
    (
        "csv_row",
        'root ::= cell ("," cell){0,3} "\\n"\ncell ::= [a-z0-9]{0,3}',
        _check_fullmatch(r"[a-z0-9]{0,3}(,[a-z0-9]{0,3}){0,3}\n", "a CSV row"),
    ),
    (
        "number_list",
        'root ::= "[" (num ("," num)*)? "]"\nnum ::= "-"? [1-9] [0-9]*',
        _check_fullmatch(r"\[(-?[1-9][0-9]*(,-?[1-9][0-9]*)*)?\]", "a number list"),
    ),
    (
        "lark_items",
        'start: item+\nitem: "x" | "y" | "zz"',
        _check_fullmatch(r"(x|y|zz)+", "x/y/zz items"),
    ),
]


def _check_tool_tags(text: str) -> None:
    # Free text; every "<f" must open "<f>" + an integer in 0..9 as JSON + "</f>".
    pos = 0
    while (start := text.find("<f", pos)) != -1:
        m = re.compile(r"<f>(.*?)</f>", re.S).match(text, start)
        assert m, f"unterminated tag at {start} in {text!r}"
        value = json.loads(m.group(1))
        assert isinstance(value, int) and 0 <= value <= 9, f"bad tag content {m.group(1)!r}"
        pos = m.end()


def _check_sequence_tag(text: str) -> None:
    assert text.startswith("A:"), f"{text!r} does not start with 'A:'"
    value = json.loads(text[2:])
    assert value in ("x", "y"), f"{value!r} not in the enum"


STRUCTURAL_TAGS: list[tuple[str, dict[str, Any] | str, Callable[[str], None]]] = [
    (
        "legacy_triggers",
        {
            "type": "structural_tag",
            "structures": [
                {
                    "begin": "<f>",
                    "schema": {"type": "integer", "minimum": 0, "maximum": 9},
                    "end": "</f>",
                }
            ],
            "triggers": ["<f"],
        },
        _check_tool_tags,
    ),
    (
        "sequence_json_string",
        json.dumps(
            {
                "type": "structural_tag",
                "format": {
                    "type": "sequence",
                    "elements": [
                        {"type": "const_string", "value": "A:"},
                        {"type": "json_schema", "json_schema": {"enum": ["x", "y"]}},
                    ],
                },
            }
        ),
        _check_sequence_tag,
    ),
]

JSON_CASES = [Case(f"json_{n}", {"json": s}, _check_json(s)) for n, s in JSON_SCHEMAS]
ALL_CASES: list[Case] = (
    JSON_CASES
    + [
        Case(
            "json_string_schema",
            {"json": json.dumps(JSON_SCHEMAS[0][1])},
            _check_json(JSON_SCHEMAS[0][1]),
        )
    ]
    + [Case("json_object", {"json_object": True}, _check_json_object)]
    + [Case(f"regex_{n}", {"regex": r}, _check_regex(r)) for n, r in REGEXES]
    + [Case(f"choice_{n}", {"choice": c}, _check_choice(c)) for n, c in CHOICES]
    + [Case(f"grammar_{n}", {"grammar": g}, chk) for n, g, chk in GRAMMARS]
    + [Case(f"structural_tag_{n}", {"structural_tag": t}, chk) for n, t, chk in STRUCTURAL_TAGS]
)

# Constraints that pass StructuredOutputsParams' own checks but cannot compile: the error
# message must name the field and contain the given fragment.
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("unknown_type", {"json": {"type": "foo"}}, "Unsupported type"),
    ("dangling_ref", {"json": {"$ref": "#/$defs/missing"}}, "$defs"),
    ("schema_not_object", {"json": "[1, 2]"}, "must be a JSON object"),
    # "not matching a pattern" has no schema without `not` (a `not {const: 3}` is written out).
    ("not_keyword", {"json": {"type": "string", "not": {"pattern": "^a"}}}, "'not'"),
    (
        "if_keyword",
        {"json": {"type": "string", "if": {"pattern": "^a"}, "then": {"maxLength": 3}}},
        "'if'",
    ),
    ("contains", {"json": {"type": "array", "items": {"type": "string"},
                                "contains": {"const": "x"}, "maxContains": 1}}, "'contains'"),
    (
        "unique_items",
        {"json": {"type": "array", "minItems": 2, "uniqueItems": True}},
        "uniqueItems",
    ),
    (
        "nested_lookahead",
        {"json": {"properties": {"a": {"type": "string", "pattern": "(?=a)a"}}}},
        "#/properties/a",
    ),
    ("regex_unclosed", {"regex": "a(b"}, "parenthesis"),
    ("regex_backref", {"regex": r"(a)\1"}, "Backreference"),
    ("regex_lookahead", {"regex": "(?!x)a"}, "lookaround"),
    ("regex_bad_repeat", {"regex": "a{,3}"}, "repetition"),
    ("grammar_undefined_rule", {"grammar": "root ::= foo"}, '"foo" is not defined'),
    ("grammar_unterminated", {"grammar": 'root ::= "a'}, "string literal"),
    ("grammar_no_root", {"grammar": 'start ::= "a"'}, "root"),
    ("lark_garbage", {"grammar": "this is not a grammar"}, ""),
    ("tag_bad_json", {"structural_tag": "{not json"}, "not valid JSON"),
    ("tag_bad_type", {"structural_tag": {"type": "nope", "format": {}}}, ""),
    (
        "tag_legacy_missing_end",
        {"structural_tag": {"structures": [{"begin": "<a>", "schema": {}}], "triggers": ["<a"]}},
        "legacy",
    ),
]

# Constraints xgrammar refuses (with the given fragment) and llguidance enforces, so the
# default `auto` backend accepts them: (name, params, xgrammar's fragment).
GUIDANCE_ONLY: list[tuple[str, dict[str, Any], str]] = [
    ("float_multiple", {"json": {"type": "number", "multipleOf": 0.5}}, "multipleOf"),
    (
        # Two patterns cannot share one node (other allOf members merge into one).
        "multi_allof",
        {"json": {"allOf": [{"type": "string", "pattern": "^[ab]{1,3}$"}, {"pattern": "^a"}]}},
        "allOf",
    ),
    (
        # A group does not fold into one count (schema/lengths.py).
        "pattern_and_length",
        {"json": {"type": "string", "pattern": "^(ab)+$", "maxLength": 3}},
        "minLength/maxLength",
    ),
    (
        "ref_siblings",
        {"json": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                  "$ref": "#/$defs/p", "required": ["x"]}},
        "beside '$ref'",
    ),
    (
        # A branch whose pattern cannot join the pattern beside it (others are distributed).
        "type_beside_anyof",
        {"json": {"type": "string", "pattern": "^[ab]{1,3}$",
                  "anyOf": [{"pattern": "^a"}, {"maxLength": 1}]}},
        "beside 'anyOf'",
    ),
    ("whitespace_pattern", {"json": {"type": "object"}, "whitespace_pattern": "[ ]{0,2}"},
     "whitespace_pattern"),
    (
        "counted_repeat_and_optional_group",
        {"json": {"type": "string", "pattern": r"^[A-Z]{1,5}(\.[A-Z]{1,2})?$"}},
        "ranged repeat",
    ),
]

# Constraints no output can satisfy (xgrammar 0.2.9 would compile most of them into an empty or
# wrong output, or a matcher that gets stuck): the error names the field and the given fragment.
UNSATISFIABLE: list[tuple[str, dict[str, Any], str]] = [
    ("empty_anyof", {"json": {"anyOf": []}}, "'anyOf' is an empty list"),
    ("empty_oneof", {"json": {"oneOf": []}}, "'oneOf' is an empty list"),
    ("empty_enum", {"json": {"enum": []}}, "'enum' is an empty list"),
    ("empty_type", {"json": {"type": []}}, "'type' is an empty list"),
    ("false_schema", {"json": "false"}, "`false`"),
    (
        "nested_empty_anyof",
        {"json": {"type": "object", "properties": {"a": {"anyOf": []}}}},
        "at #/properties/a: 'anyOf'",
    ),
    (
        "required_not_allowed",
        {
            "json": {
                "type": "object",
                "properties": {},
                "required": ["a"],
                "additionalProperties": False,
            }
        },
        "required property 'a'",
    ),
    (
        "required_not_allowed_by_option",
        {
            "json": {"type": "object", "properties": {"b": {}}, "required": ["a"]},
            "disable_additional_properties": True,
        },
        "required property 'a'",
    ),
    (
        "required_not_matching_pattern",
        {
            "json": {
                "type": "object",
                "patternProperties": {"^x": {}},
                "required": ["a"],
                "additionalProperties": False,
            }
        },
        "required property 'a'",
    ),
    (
        "required_false",
        {"json": {"type": "object", "properties": {"a": False}, "required": ["a"]}},
        "has the schema false",
    ),
    (
        "required_over_max_properties",
        {"json": {"type": "object", "required": ["a", "b"], "maxProperties": 1}},
        "maxProperties",
    ),
    ("length", {"json": {"type": "string", "minLength": 5, "maxLength": 2}}, "minLength (5)"),
    ("items", {"json": {"type": "array", "minItems": 3, "maxItems": 1}}, "minItems (3)"),
    (
        "properties",
        {"json": {"type": "object", "minProperties": 3, "maxProperties": 1}},
        "minProperties (3)",
    ),
    ("range", {"json": {"type": "number", "minimum": 3, "maximum": 2}}, "between 3 and 2"),
    (
        "exclusive_range",
        {"json": {"type": "number", "exclusiveMinimum": 2, "maximum": 2}},
        "between 2 and 2",
    ),
    (
        "no_integer_in_range",
        {"json": {"type": "integer", "minimum": 1.2, "maximum": 1.8}},
        "no integer",
    ),
    ("grammar_left_recursive", {"grammar": 'root ::= root "a"'}, "rule 'root' can never finish"),
    ("grammar_cycle", {"grammar": "root ::= a\na ::= b\nb ::= a"}, "can never finish"),
    (
        "grammar_stuck_branch",
        {"grammar": 'root ::= "c" | "a" x\nx ::= "b" x'},
        "rule 'x' can never finish",
    ),
    ("grammar_stuck_repeat", {"grammar": "root ::= x{1,2}\nx ::= x"}, "rule 'root'"),
    ("lark_left_recursive", {"grammar": 'start: start "a"'}, "rule 'start' can never finish"),
]

# Near misses of UNSATISFIABLE that some output does satisfy: (name, params, a valid output).
SATISFIABLE_EDGES: list[tuple[str, dict[str, Any], str]] = [
    (
        "required_matching_pattern",
        {
            "json": {
                "type": "object",
                "patternProperties": {"^a.*": {"type": "integer"}},
                "required": ["ab"],
                "additionalProperties": False,
            },
            "disable_any_whitespace": True,
        },
        '{"ab":1}',
    ),
    ("equal_bounds", {"json": {"type": "integer", "minimum": 2, "maximum": 2}}, "2"),
    (
        "exclusive_integer",
        {"json": {"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 3}},
        "2",
    ),
    ("left_recursion_with_exit", {"grammar": 'root ::= "b" | root "a"'}, "baaa"),
    ("lark_left_recursion_with_exit", {"grammar": 'start: "b" | start "a"'}, "baa"),
    ("optional_useless_repeat", {"grammar": 'root ::= "a" x{0,0}\nx ::= "b"'}, "a"),
]
