"""The differential check (differential.py) at CI size, and one regression test per rule it
led to: every backend, on generated schemas with a fixed seed, accepts no value jsonschema
refuses; each combination found wrong is refused by name or rewritten exactly.

At scale: scripts/differential_check.py --schemas 10000 (numbers in the README)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from tests.v1.structured_output.differential import Checker, Tally, is_valid
from tests.v1.structured_output.schema_gen import DRAFTS, SchemaGen, schemas
from tests.v1.structured_output.walker import WalkVocab, token_bytes
from vllm.config import StructuredOutputsConfig
from vllm.exceptions import GrammarCompileError, UnsupportedConstraintError
from vllm.model_executor.model_loader.demos import resolve_model_dir
from vllm.sampling_params import StructuredOutputsParams
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.structured_output.backends.auto import create_backend
from vllm.v1.structured_output.schema.patterns import anchor
from vllm.v1.structured_output.schema.regex_tree import finite_language

SEED = 20261207
# Per backend; outlines compiles an index per schema, so it gets fewer.
COUNTS = {"xgrammar": 150, "guidance": 150, "outlines": 60, "lm-format-enforcer": 150}


@pytest.fixture(scope="module")
def small_vocab() -> tuple[Any, int, int, WalkVocab]:
    """The small demo vocabulary (8k tokens): every backend compiles in milliseconds."""
    model_dir = resolve_model_dir("demo-small-vocab")
    tokenizer = get_tokenizer(model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab_size = 8256
    return tokenizer, vocab_size, eos, WalkVocab.build(token_bytes(tokenizer), vocab_size, [eos])


def _checker(name: str, small_vocab: tuple[Any, int, int, WalkVocab]) -> Checker:
    tokenizer, vocab_size, eos, vocab = small_vocab
    backend = create_backend(StructuredOutputsConfig(backend=name), tokenizer, vocab_size, [eos])
    return Checker(name, backend, tokenizer, vocab, eos)


def test_the_generator_covers_the_keywords_and_drafts() -> None:
    generated = schemas(SEED, 300)
    text = " ".join(map(str, generated))
    for keyword in ("multipleOf", "minimum", "pattern", "format", "prefixItems", "contains",
                    "uniqueItems", "patternProperties", "propertyNames", "dependentRequired",
                    "dependencies", "additionalProperties", "$ref", "anyOf", "oneOf", "allOf",
                    "'not'", "'if'", "enum", "const", "exclusiveMinimum"):
        assert keyword in text, keyword
    assert {s["$schema"] for s in generated} == set(DRAFTS.values())
    # The same seed gives the same schemas (the failures below are reproducible).
    assert schemas(SEED, 5) == schemas(SEED, 5)
    assert SchemaGen(random.Random(1), "draft-04").root() != SchemaGen(
        random.Random(2), "draft-04").root()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COUNTS))
def test_no_backend_accepts_what_jsonschema_refuses(name: str, small_vocab) -> None:
    checker = _checker(name, small_vocab)
    tally, rng = Tally(), random.Random(SEED)
    for schema in schemas(SEED, COUNTS[name]):
        checker.check(schema, rng, tally)
    unsound = [(f.schema, f.text) for f in tally.findings if f.kind == "unsound"]
    assert unsound == []
    # Every valid value refused is refused by a declared narrowing (narrowings.py).
    unexplained = [(f.schema, f.text) for f in tally.findings if f.kind == "unexplained"]
    assert unexplained == []
    assert tally.accepted >= COUNTS[name] // 5 and tally.instances >= 20 * tally.accepted


# ---------------------------------------------------------------------------- the rules

def _auto(small_vocab: tuple[Any, int, int, WalkVocab]) -> Checker:
    tokenizer, vocab_size, eos, vocab = small_vocab
    backend = create_backend(StructuredOutputsConfig(), tokenizer, vocab_size, [eos])
    return Checker("auto", backend, tokenizer, vocab, eos)


def _compile(checker: Checker, schema: dict[str, Any]) -> Any:
    return checker.backend.compile_grammar(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True))


def test_integer_multiple_beside_a_bound(small_vocab) -> None:
    """xgrammar 0.2.9 drops `multipleOf` beside a bound (it wrote `{"length":4}`)."""
    schema = {"type": "object", "properties": {
        "length": {"type": "integer", "minimum": 0, "multipleOf": 12}}, "required": ["length"]}
    with pytest.raises(UnsupportedConstraintError, match="'multipleOf' beside 'minimum'"):
        _compile(_checker("xgrammar", small_vocab), schema)
    auto = _auto(small_vocab)
    grammar = _compile(auto, schema)
    assert auto.accepts(grammar, '{"length":24}') and not auto.accepts(grammar, '{"length":4}')


def test_draft04_required_beside_pattern_properties(small_vocab) -> None:
    """The round's second sample: a draft-04 root's `required` beside an object property with
    `additionalProperties: false` and `patternProperties`."""
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "required": ["controller", "hosts", "services"],
              "properties": {"controller": {"type": "object", "additionalProperties": False,
                                            "patternProperties": {"^x": {"type": "string"}}},
                             "hosts": {"type": "array"}, "services": {"type": "array"}}}
    auto = _auto(small_vocab)
    grammar = _compile(auto, schema)
    assert not auto.accepts(grammar, '{"controller":{}}')
    assert auto.accepts(grammar, '{"controller":{},"hosts":[],"services":[]}')


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_enum_values_obey_their_sibling_keywords(name: str, small_vocab) -> None:
    """xgrammar and outlines enforced the listed values alone (null passed `type: number`)."""
    checker = _checker(name, small_vocab)
    grammar = _compile(checker, {"enum": [2.5, None, "a"], "type": "number"})
    assert checker.accepts(grammar, "2.5") and not checker.accepts(grammar, "null")
    with pytest.raises(GrammarCompileError, match="no value satisfies"):
        _compile(checker, {"enum": ["a", ""], "type": "number"})
    with pytest.raises(UnsupportedConstraintError, match="'enum' with no value"):
        _compile(checker, {"type": "object", "properties": {"r": {"enum": ["a"], "type": "null"}}})
    # In an anyOf the branch goes, and the others stay.
    grammar = _compile(checker, {"anyOf": [{"enum": ["a"], "type": "null"}, {"type": "boolean"}]})
    assert checker.accepts(grammar, "true") and not checker.accepts(grammar, '"a"')


def test_pattern_properties_overlapping_a_listed_property(small_vocab) -> None:
    """xgrammar let a listed property take the pattern's schema instead of both."""
    schema = {"type": "object", "properties": {"a": {"type": ["null", "integer"]}},
              "propertyNames": {"maxLength": 1}}
    with pytest.raises(UnsupportedConstraintError, match="matches the listed property 'a'"):
        _compile(_checker("xgrammar", small_vocab), schema)
    auto = _auto(small_vocab)
    grammar = _compile(auto, schema)
    assert auto.accepts(grammar, '{"a":1}') and not auto.accepts(grammar, '{"a":12.5}')


def test_patterns_match_anywhere_in_the_string(small_vocab) -> None:
    """A pattern is searched for, not matched whole: xgrammar refused "ax" for `^a`."""
    assert anchor("^a") == "^(?:a)[\\s\\S]*$" and anchor("x") == "^[\\s\\S]*(?:x)[\\s\\S]*$"
    assert anchor("^a$|^b$") == "^a$|^b$" and anchor("^a|b$") is None
    checker = _checker("xgrammar", small_vocab)
    grammar = _compile(checker, {"type": "string", "pattern": "^a"})
    assert checker.accepts(grammar, '"ax"') and not checker.accepts(grammar, '"xa"')
    with pytest.raises(UnsupportedConstraintError, match="anchor or word boundary"):
        _compile(checker, {"type": "string", "pattern": "^a|b$"})


def test_ipv4_with_leading_zeros(small_vocab) -> None:
    """xgrammar writes octets with leading zeros ("088.81.46.77"), which ipv4 forbids."""
    assert not is_valid("088.81.46.77", {"type": "string", "format": "ipv4"})
    with pytest.raises(UnsupportedConstraintError, match="format 'ipv4'"):
        _compile(_checker("xgrammar", small_vocab), {"type": "string", "format": "ipv4"})


@pytest.mark.parametrize("schema, what", [
    ({"type": "integer"}, "numbers"),
    ({"type": "array"}, "array items of any type"),
    ({"type": "object", "additionalProperties": False}, "listing no property"),
    ({"type": "array", "items": {"type": "string"}, "maxItems": 0}, "'maxItems: 0'"),
    ({"type": "string", "maxLength": 5}, "'maxLength'"),
])
def test_what_lm_format_enforcer_gets_wrong(schema: dict[str, Any], what: str,
                                           small_vocab) -> None:
    """Found by the check: `76.E02` for a number, any key in a closed empty object, items
    beside `maxItems: 0`, strings one character past `maxLength`."""
    with pytest.raises(UnsupportedConstraintError, match=what):
        _compile(_checker("lm-format-enforcer", small_vocab), schema)


def test_lm_format_enforcer_stops_only_on_json(small_vocab) -> None:
    """The library read a string as closed after " »" and allowed the stop there."""
    checker = _checker("lm-format-enforcer", small_vocab)
    grammar = _compile(checker, {"type": "string", "minLength": 3})
    tokens = checker.tokenizer.encode('"ab »', add_special_tokens=False)
    accepted = grammar.validate_tokens(tokens + [checker.eos_id])
    assert checker.eos_id not in accepted


def test_what_the_check_found_at_scale(small_vocab) -> None:
    """Each found by the 10,000-schema run: refused where the backend would let a wrong
    value through, served exactly by `auto` where another backend enforces it."""
    xgrammar = _checker("xgrammar", small_vocab)
    guidance = _checker("guidance", small_vocab)
    # Feb 30 passed xgrammar's date; llguidance checks the month.
    with pytest.raises(UnsupportedConstraintError, match="days past the month's end"):
        _compile(xgrammar, {"type": "string", "format": "date"})
    auto = _auto(small_vocab)
    grammar = _compile(auto, {"type": "string", "format": "date"})
    assert auto.accepts(grammar, '"2023-02-28"') and not auto.accepts(grammar, '"2023-02-30"')
    # A propertyNames the rewrites leave (the listed `d` fails it) is no longer ignored.
    with pytest.raises(UnsupportedConstraintError, match="'propertyNames' keyword"):
        _compile(xgrammar, {"type": "object", "properties": {"d": {}}, "required": ["d"],
                            "propertyNames": {"pattern": "^[a-c]$"}})
    # A key matching a pattern took the additional schema ("xq": "a" past `^x`: array).
    with pytest.raises(UnsupportedConstraintError, match="beside an 'additionalProperties'"):
        _compile(xgrammar, {"type": "object", "additionalProperties": {"type": "string"},
                            "patternProperties": {"^x": {"type": "array"}}})
    # {"b": 1, "b": 2} passed minProperties 2 on both: JSON keeps the last key.
    for checker in (xgrammar, guidance):
        with pytest.raises(UnsupportedConstraintError, match="cannot keep from repeating"):
            _compile(checker, {"type": "object", "minProperties": 2})
    # 0 passed exclusiveMinimum 0 beside maximum 0.5 on llguidance (a wider range is fine).
    with pytest.raises(UnsupportedConstraintError, match="admits 0"):
        _compile(guidance, {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5})
    grammar = _compile(guidance, {"type": "number", "exclusiveMinimum": 0, "maximum": 500})
    assert not guidance.accepts(grammar, "0") and guidance.accepts(grammar, "0.5")


def test_what_the_narrowing_check_found(small_vocab) -> None:
    """Each an unexplained refusal (or, for llguidance's bounds, an unsound value) of the
    check that tells declared narrowings from the rest (narrowings.py)."""
    guidance = _checker("guidance", small_vocab)
    # Mirrored open bound: -2 passed `minimum: -2.9, exclusiveMaximum: -2`.
    with pytest.raises(UnsupportedConstraintError, match="admits -2"):
        _compile(guidance, {"type": "number", "minimum": -2.9, "exclusiveMaximum": -2})
    # A fractional multipleOf beside bounds: each bound becomes an inclusive multiple.
    grammar = _compile(guidance, {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.01})
    assert guidance.accepts(grammar, "0.10") and not guidance.accepts(grammar, "0")
    grammar = _compile(guidance, {"type": "number", "maximum": 2.69, "multipleOf": 0.1})
    assert guidance.accepts(grammar, "2.6") and not guidance.accepts(grammar, "2.7")
    # ... and a divisor it gets wrong beside a bound is refused (-0.50 failed minimum -2.5).
    with pytest.raises(UnsupportedConstraintError, match="'multipleOf' 0.25 beside a bound"):
        _compile(guidance, {"type": "number", "minimum": -2.5, "multipleOf": 0.25})
    # propertyNames of a few names, all listed: llguidance allowed a comma after the last one
    # and then no key (a dead end); the names are now the listed properties.
    assert finite_language("^[a-c]$") == ["a", "b", "c"] and finite_language("^[a-c]+$") is None
    grammar = _compile(guidance, {"type": "object", "properties": {
        "a": {"type": "null"}, "b": {"type": "null"}, "c": {"type": "null"}},
        "propertyNames": {"pattern": "^[a-c]$"}})
    tokens = guidance.tokenizer.encode('{"a":null,"b":null,"c":null', add_special_tokens=False)
    assert grammar.validate_tokens(tokens + guidance.tokenizer.encode(",")) == tokens
    # draft-04 has no propertyNames: jsonschema ignores it, so the engine does.
    grammar = _compile(guidance, {"$schema": DRAFTS["draft-04"], "type": "object",
                                  "propertyNames": {"maxLength": 1}})
    assert guidance.accepts(grammar, '{"xq":"a"}')


def test_lm_format_enforcer_reads_every_character_of_a_string(small_vocab) -> None:
    """Dead ends and refusals of lm-format-enforcer 0.11.3 the check found: it read a string
    as closed at a character no token starts with (" ©"), then allowed nothing."""
    checker = _checker("lm-format-enforcer", small_vocab)
    grammar = _compile(checker, {"type": "string"})
    assert grammar.accept_tokens("t", checker.tokenizer.encode('"a ©', add_special_tokens=False))
    row = np.zeros((1, (checker.vocab.vocab_size + 31) // 32), dtype=np.int32)
    grammar.fill_bitmask(row, 0)
    assert row.any()
    assert checker.accepts(_compile(checker, {"type": "string"}), '"a ©"')
    # It allowed `}` right after a comma (`{"b":null,}`), then nothing.
    schema = {"type": "object", "properties": {"b": {"type": "null"}, "a": {"type": "boolean"}}}
    grammar = _compile(checker, schema)
    tokens = checker.tokenizer.encode('{"b":null,', add_special_tokens=False)
    closer = checker.tokenizer.encode("}", add_special_tokens=False)
    assert grammar.validate_tokens(tokens + closer) == tokens
    assert checker.accepts(_compile(checker, schema), '{"b":null,"a":true}')
    # It failed on a boolean property schema once it started the name (`false` is the
    # oneOf rewrite's "absent"): a dead end; `false` goes, `true` reads as `{}`.
    schema = {"type": "object", "properties": {"d": False, "a": {"type": "string"}}}
    grammar = _compile(checker, schema)
    opener = checker.tokenizer.encode('{"', add_special_tokens=False)
    assert grammar.validate_tokens(checker.tokenizer.encode('{"d', add_special_tokens=False)) \
        == opener
    assert checker.accepts(_compile(checker, schema), '{"a":"x"}')
    # Outside its free-text shortcut (a string in an anyOf) it let a raw NUL into a string.
    grammar = _compile(checker, {"anyOf": [{"type": "string"}, {"type": "null"}]})
    nul = next(i for i in range(checker.vocab.vocab_size)
               if checker.tokenizer.decode([i]) == "\x00")
    quote = checker.tokenizer.encode('"a', add_special_tokens=False)
    assert grammar.validate_tokens(quote + [nul]) == quote
    # It counted null, boolean and array items about twice: `maxItems: 3` took two.
    with pytest.raises(UnsupportedConstraintError, match="counts them about twice"):
        _compile(checker, {"type": "array", "items": {"type": "null"}, "maxItems": 3})
    grammar = _compile(checker, {"type": "array", "items": {"type": "string"}, "maxItems": 3})
    assert checker.accepts(grammar, '["a","b","c"]')


def test_what_the_check_found_on_outlines_and_formats(small_vocab) -> None:
    """outlines-core 0.2.14 drops the steps from a final state of its index ("2" never became
    "2.5" as the whole output), writes every listed tuple item (`[]` was refused) and only
    the listed properties; a `const` beside a `format` was written alone (`""` for `format:
    email`)."""
    outlines = _checker("outlines", small_vocab)
    with pytest.raises(UnsupportedConstraintError, match="fraction as the whole output"):
        _compile(outlines, {"type": "number"})
    grammar = _compile(outlines, {"type": "array", "items": {"type": "number"}})
    assert outlines.accepts(grammar, "[2.5]")
    grammar = _compile(outlines, {"type": "array", "prefixItems": [{"type": "string"},
                                                                   {"type": "boolean"}]})
    assert all(outlines.accepts(grammar, t) for t in ('[]', '["a"]', '["a",true]'))
    assert not outlines.accepts(grammar, '[true]')
    with pytest.raises(UnsupportedConstraintError, match="'items' after 'prefixItems'"):
        _compile(outlines, {"type": "array", "prefixItems": [{"type": "string"}],
                            "items": {"type": "boolean"}})
    # Its `uri` regex let a raw quote into the string; only uuid is taken.
    with pytest.raises(UnsupportedConstraintError, match="string format 'uri'"):
        _compile(outlines, {"type": "string", "format": "uri"})
    # Both compatibility libraries write the listed properties only.
    for name in ("outlines", "lm-format-enforcer"):
        with pytest.raises(UnsupportedConstraintError, match="'additionalProperties' beside"):
            _compile(_checker(name, small_vocab), {
                "type": "object", "properties": {"a": {"type": "string"}},
                "additionalProperties": {"type": "string"}})
    with pytest.raises(GrammarCompileError, match="no value satisfies"):
        _compile(outlines, {"allOf": [{"const": ""}, {"type": "string", "format": "email"}]})
    with pytest.raises(UnsupportedConstraintError, match="beside 'format' 'date-time'"):
        _compile(outlines, {"enum": ["x", "2024-01-02T03:04:05Z"], "format": "date-time"})


def test_outlines_any_value_and_shorter_tuples_keep_their_meaning(small_vocab) -> None:
    """Found at 10,000 schemas: outlines-core 0.2.14 writes a property whose schema is `{}`
    (any value; the propertyNames rewrite lists names that way) as an alternation it does
    not group, so `"a":null` let text follow the value (`{"b":3,"c":null641.5}`, not JSON)
    and refused valid objects; and the shorter tuples spelled out for it dropped the array's
    other keywords (`[]` passed a `contains`)."""
    outlines = _checker("outlines", small_vocab)
    schema = {"type": "object", "properties": {"a": {}, "b": {"type": "null"}},
              "additionalProperties": False}
    grammar = _compile(outlines, schema)
    assert outlines.accepts(grammar, '{"a":[1,{"x":"y"}],"b":null}')
    assert outlines.accepts(_compile(outlines, schema), '{"b":null}')
    assert not outlines.accepts(_compile(outlines, schema), '{"a":1null}')
    grammar = _compile(outlines, {"type": "object", "propertyNames": {"pattern": "^[a-c]$"}})
    assert outlines.accepts(grammar, '{"a":1,"c":"x"}')
    assert not outlines.accepts(_compile(outlines, {
        "type": "object", "propertyNames": {"pattern": "^[a-c]$"}}), '{"a":1null}')
    with pytest.raises(UnsupportedConstraintError, match="'contains'"):
        _compile(outlines, {"type": "array", "prefixItems": [{"type": "string"},
                                                             {"type": "boolean"}],
                            "contains": {"type": "string"}, "maxItems": 1})


def test_schema_rewrites_leave_literal_values_alone(small_vocab) -> None:
    """The rewrites for outlines walk schema positions only: a `const` object that looks like
    a tuple schema is a value to write as it is, not an array to spell out."""
    outlines = _checker("outlines", small_vocab)
    value = {"type": "array", "prefixItems": [{"type": "string"}]}
    grammar = _compile(outlines, {"const": value})
    assert outlines.accepts(grammar, '{"type":"array","prefixItems":[{"type":"string"}]}')
