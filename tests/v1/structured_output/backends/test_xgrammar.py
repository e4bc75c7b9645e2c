"""The xgrammar backend against independent oracles, with the demo model's Qwen vocabulary."""

from __future__ import annotations

import codecs
import json
import zlib
from typing import Any

import numpy as np
import pytest

from vllm.exceptions import UnsupportedConstraintError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backends.xgrammar import XgrammarBackend
from vllm.v1.structured_output.schema.grammar_checks import find_lookaround, find_stuck_rule
from vllm.v1.structured_output.schema.normalize import normalize_json_schema

from tests.v1.structured_output.conftest import EOS_IDS, VOCAB_SIZE
from tests.v1.structured_output.schemas import (
    ALL_CASES,
    CHOICES,
    GUIDANCE_ONLY,
    INVALID,
    JSON_SCHEMAS,
    SATISFIABLE_EDGES,
    UNSATISFIABLE,
    Case,
)
from tests.v1.structured_output.walker import WalkVocab, allowed_token_ids, random_walk

# Qwen's special tokens (151643..151656) and the ids past its tokenizer (151669..) are never
# text; its other added tokens (<tool_call> 151657 ... <think> 151667, </think> 151668) are.
SPECIAL_IDS = frozenset(range(151_643, 151_657))
TOKENIZER_END = 151_669
SPACE, NEWLINE, TAB = 220, 198, 197
CONTROL_01 = 189  # the byte 0x01 alone


def _rng(name: str, salt: int) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()) * 7 + salt)


def _allowed(grammar: Any) -> np.ndarray:
    bitmask = np.zeros((1, (VOCAB_SIZE + 31) // 32), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 0)
    return allowed_token_ids(bitmask[0], VOCAB_SIZE)


def _forbidden_allowed(ids: np.ndarray) -> list[int]:
    """Allowed ids that are Qwen special tokens (other than stops) or past the tokenizer."""
    return [int(i) for i in ids
            if (i in SPECIAL_IDS or i >= TOKENIZER_END) and i not in EOS_IDS]


def _whitespace_outside_strings(text: str) -> bool:
    in_string = escaped = False
    for c in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c.isspace():
            return True
    return False


def test_corpus_is_large_enough() -> None:
    assert len(JSON_SCHEMAS) >= 40
    assert len({name for name, _ in JSON_SCHEMAS}) == len(JSON_SCHEMAS)


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_random_walks_satisfy_the_constraint(
    case: Case,
    backend: XgrammarBackend,
    tokenizer: Any,
    walk_vocab: WalkVocab,
    pieces: list[bytes],
) -> None:
    json_kind = "json" in case.params or "json_object" in case.params
    for compact in (False, True) if json_kind else (False,):
        params = case.make_params(disable_any_whitespace=compact)
        grammar = backend.compile_grammar(params)
        tokens, stopped = random_walk(grammar, walk_vocab, _rng(case.name, compact))
        assert stopped, f"walk did not finish: {tokenizer.decode(tokens)!r}"
        assert grammar.is_terminated()
        assert tokens[-1] in EOS_IDS
        body = tokens[:-1]
        assert not _forbidden_allowed(np.array(body, dtype=np.int64)), body
        text = tokenizer.decode(body, skip_special_tokens=False)
        case.check(text)
        b"".join(pieces[t] for t in body).decode("utf-8")  # strict: raises on invalid UTF-8
        if compact:
            assert not _whitespace_outside_strings(text), text
        fresh = backend.compile_grammar(params)
        assert fresh.accept_tokens("fresh", tokens)
        assert fresh.is_terminated() and fresh.num_processed_tokens == len(tokens)


@pytest.mark.parametrize("name,choices", CHOICES, ids=[n for n, _ in CHOICES])
def test_choice_accepts_exactly_its_members(
    name: str, choices: list[str], backend: XgrammarBackend, tokenizer: Any
) -> None:
    grammar = backend.compile_grammar(StructuredOutputsParams(choice=choices))
    for member in choices:
        grammar.rollback(grammar.num_processed_tokens)
        tokens = tokenizer.encode(member, add_special_tokens=False)
        assert grammar.accept_tokens("r", tokens + [EOS_IDS[0]]), member
        assert grammar.is_terminated()
    for outsider in [choices[0] + "x", "zz" + choices[-1]]:
        if outsider in choices:
            continue
        grammar.rollback(grammar.num_processed_tokens)
        tokens = tokenizer.encode(outsider, add_special_tokens=False)
        assert not grammar.accept_tokens("r", tokens + [EOS_IDS[0]]), outsider


def test_masked_tokens_never_allowed(backend: XgrammarBackend, tokenizer: Any) -> None:
    # At positions where nearly any text is allowed (inside JSON strings, free regex, any-char
    # grammar), Qwen's control tokens and the ids past the tokenizer stay masked.
    cases = [
        ({"json": {"type": "object", "properties": {"s": {"type": "string"}}}}, '{"s": "ab'),
        ({"json_object": True}, '{"k": "v'),
        ({"regex": ".{0,20}"}, "hi "),
        ({"grammar": 'root ::= [^"]*'}, "x"),
    ]
    for params, prefix in cases:
        grammar = backend.compile_grammar(StructuredOutputsParams(**params))
        assert grammar.accept_tokens("r", tokenizer.encode(prefix, add_special_tokens=False))
        allowed = _allowed(grammar)
        assert len(allowed) > 100_000, params  # free text really is allowed here
        assert _forbidden_allowed(allowed) == [], params
        before = grammar.num_processed_tokens
        for control in (151644, 151646, 151656, 151700, VOCAB_SIZE - 1):
            assert not grammar.accept_tokens("r", [control])
        assert grammar.num_processed_tokens == before
        assert np.array_equal(_allowed(grammar), allowed)
    assert backend.masked_token_ids >= set(range(151669, VOCAB_SIZE))
    assert backend.masked_token_ids.isdisjoint(EOS_IDS)


def test_structural_tag_enforces_tag_content(backend: XgrammarBackend, tokenizer: Any) -> None:
    tag = next(c for c in ALL_CASES if c.name == "structural_tag_legacy_triggers").params
    grammar = backend.compile_grammar(StructuredOutputsParams(**tag))
    good = tokenizer.encode("call <f>7</f> done", add_special_tokens=False)
    assert grammar.accept_tokens("r", good + [EOS_IDS[0]])
    grammar.rollback(grammar.num_processed_tokens)
    assert not grammar.accept_tokens("r", tokenizer.encode("call <f>x", add_special_tokens=False))


@pytest.mark.parametrize("name,params,fragment", INVALID, ids=[n for n, _, _ in INVALID])
def test_invalid_constraints_raise_clear_errors(
    name: str, params: dict[str, Any], fragment: str, backend: XgrammarBackend
) -> None:
    field = next(iter(params))
    with pytest.raises(ValueError) as info:
        backend.compile_grammar(StructuredOutputsParams(**params))
    message = str(info.value)
    assert message.startswith(f"structured_outputs.{field}"), message
    assert fragment in message, message
    assert "/project/cpp" not in message  # no native log prefix


@pytest.mark.parametrize(
    "name,params,fragment", GUIDANCE_ONLY, ids=[n for n, _, _ in GUIDANCE_ONLY]
)
def test_what_xgrammar_would_drop_is_refused_for_the_next_backend(
    name: str, params: dict[str, Any], fragment: str, backend: XgrammarBackend
) -> None:
    with pytest.raises(UnsupportedConstraintError) as info:
        backend.compile_grammar(StructuredOutputsParams(**params))
    assert fragment in str(info.value)


def test_two_constraints_are_rejected_by_the_params() -> None:
    with pytest.raises(ValueError, match="json, regex"):
        StructuredOutputsParams(json={"type": "integer"}, regex="a")
    with pytest.raises(ValueError, match="none"):
        StructuredOutputsParams()


def test_normalize_json_schema_rewrites_a_copy() -> None:
    schema = {
        "type": "object",
        "properties": {
            # Property names that are also keywords must not be mistaken for keywords.
            "not": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "if": {"type": "string", "maxLength": 3},
            "open": {"type": "object", "additionalProperties": True},
        },
        "$defs": {"d": {"type": "object"}, "unused": {"type": "object"}},
    }
    schema["properties"]["ref"] = {"$ref": "#/$defs/d"}
    original = json.loads(json.dumps(schema))
    out = normalize_json_schema(schema, disable_additional_properties=True)
    assert schema == original
    assert out["additionalProperties"] is False
    assert out["properties"]["not"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "unused" not in out["$defs"]  # nothing references it
    assert out["properties"]["if"] == schema["properties"]["if"]
    kept = normalize_json_schema(schema)
    assert "additionalProperties" not in kept and "additionalProperties" not in kept["$defs"]["d"]


def test_bounded_strings_exclude_raw_control_characters(
    backend: XgrammarBackend, tokenizer: Any
) -> None:
    # xgrammar 0.2.9 alone lets a raw tab into {"maxLength": n} strings and bounded property
    # names (invalid JSON).
    schemas = [
        ({"type": "string", "minLength": 1, "maxLength": 4}, '"'),
        ({"type": "object", "propertyNames": {"maxLength": 3}}, '{"'),
    ]
    for schema, prefix in schemas:
        grammar = backend.compile_grammar(StructuredOutputsParams(json=schema))
        assert grammar.accept_tokens("r", tokenizer.encode(prefix, add_special_tokens=False))
        allowed = set(_allowed(grammar).tolist())
        assert not {TAB, NEWLINE, CONTROL_01} & allowed, schema
        assert not grammar.accept_tokens("r", [TAB])
        assert grammar.accept_tokens("r", tokenizer.encode("ab", add_special_tokens=False))


@pytest.mark.parametrize(
    "regex,expected",
    [
        ("(?=a)a", "(?="),
        ("x(?<!y)", "(?<!"),
        (r"\(?=a", None),
        ("[(?=]", None),
        ("[]](?!b)", "(?!"),
        ("(?:ab)+", None),
    ],
)
def test_find_lookaround(regex: str, expected: str | None) -> None:
    assert find_lookaround(regex) == expected


def test_allocate_token_bitmask(backend: XgrammarBackend) -> None:
    bitmask = backend.allocate_token_bitmask(3)
    assert bitmask.shape == (3, 4748) and bitmask.dtype == np.int32
    assert (bitmask == -1).all()
    with pytest.raises(ValueError, match="max_num_seqs"):
        backend.allocate_token_bitmask(0)


@pytest.mark.parametrize(
    "name,params,fragment", UNSATISFIABLE, ids=[n for n, _, _ in UNSATISFIABLE]
)
def test_unsatisfiable_constraints_are_rejected(
    name: str, params: dict[str, Any], fragment: str, backend: XgrammarBackend
) -> None:
    field = next(iter(params))
    with pytest.raises(ValueError) as info:
        backend.compile_grammar(StructuredOutputsParams(**params))
    message = str(info.value)
    assert message.startswith(f"structured_outputs.{field}: "), message
    assert fragment in message, message


@pytest.mark.parametrize(
    "name,params,output", SATISFIABLE_EDGES, ids=[n for n, _, _ in SATISFIABLE_EDGES]
)
def test_satisfiable_edges_are_accepted(
    name: str, params: dict[str, Any], output: str, backend: XgrammarBackend, tokenizer: Any
) -> None:
    grammar = backend.compile_grammar(StructuredOutputsParams(**params))
    tokens = tokenizer.encode(output, add_special_tokens=False)
    assert grammar.accept_tokens("edge", tokens + [EOS_IDS[0]])
    assert grammar.is_terminated()


def test_first_step_check_catches_what_the_static_checks_miss(
    backend: XgrammarBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.v1.structured_output.schema.grammar_checks as grammar_checks
    import vllm.v1.structured_output.schema.normalize as json_schema

    monkeypatch.setattr(grammar_checks, "find_stuck_rule", lambda grammar: None)
    grammar_checks.check_grammar_text.cache_clear()
    with pytest.raises(ValueError, match=r"^structured_outputs.grammar: .*accepts no output"):
        backend.compile_grammar(StructuredOutputsParams(grammar='root ::= root "q"'))
    monkeypatch.setattr(json_schema, "check_satisfiable", lambda node, path: None)
    with pytest.raises(ValueError, match=r"^structured_outputs.json: .*only an empty output"):
        backend.compile_grammar(StructuredOutputsParams(json={"oneOf": []}))
    grammar_checks.check_grammar_text.cache_clear()


def test_find_stuck_rule_reads_every_expression_kind() -> None:
    import xgrammar as xgr

    fine = (
        'root ::= [a-z]* "x"? ("y" | "z"){2,3} "q"+ "" tail (= "!")\n'
        'tail ::= TagDispatch(("<a>", inner), ("<b>", inner))\ninner ::= [0-9] | "(" inner ")"'
    )
    assert find_stuck_rule(xgr.Grammar.from_ebnf(fine)) is None
    stuck = fine.replace('inner ::= [0-9] | "(" inner ")"', 'inner ::= "(" inner ")"')
    assert find_stuck_rule(xgr.Grammar.from_ebnf(stuck)) == "inner"


# UTF-8 lead bytes whose next byte is restricted, with a forbidden and an allowed next byte.
_RESTRICTED = [(0xE0, 0x80, 0xA0), (0xED, 0xA0, 0x80), (0xF0, 0x80, 0x90), (0xF4, 0x90, 0x80)]


@pytest.mark.parametrize(
    "params,prefix",
    [
        ({"json": {"type": "string", "maxLength": 8}}, '"'),
        ({"json": {"type": "string"}}, '"'),
        ({"json": {"type": "string", "pattern": "^.{1,8}$"}}, '"'),
        ({"regex": ".{1,8}"}, ""),
        ({"grammar": "root ::= [^a]*"}, ""),
    ],
    ids=["max_length", "string", "pattern", "regex", "grammar"],
)
def test_outputs_stay_valid_utf8(
    params: dict[str, Any],
    prefix: str,
    backend: XgrammarBackend,
    tokenizer: Any,
    pieces: list[bytes],
) -> None:
    """xgrammar alone accepts encoded surrogates (and overlong forms inside patterns), which
    decode to several U+FFFD: a string with maxLength 8 came back 10 characters long."""
    by_byte = {piece[0]: idx for idx, piece in enumerate(pieces) if len(piece) == 1}
    start = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    for lead, bad_next, good_next in _RESTRICTED:
        grammar = backend.compile_grammar(StructuredOutputsParams(**params))
        assert grammar.accept_tokens("utf8", start + [by_byte[lead]])
        allowed = _allowed(grammar)
        for token in allowed:
            if int(token) in EOS_IDS:
                continue
            decoder = codecs.getincrementaldecoder("utf-8")()
            # Raises UnicodeDecodeError when lead + token cannot begin valid UTF-8.
            decoder.decode(bytes([lead]) + pieces[int(token)], final=False)
        assert by_byte[good_next] in allowed
        assert not grammar.accept_tokens("utf8", [by_byte[bad_next]])
        assert grammar.validate_tokens([by_byte[bad_next]]) == []
        batch = np.zeros((1, (VOCAB_SIZE + 31) // 32), dtype=np.int32)
        backend.fill_bitmasks([grammar], batch, [0])
        assert np.array_equal(allowed_token_ids(batch[0], VOCAB_SIZE), allowed)
        # Rolling the lead back lifts the restriction.
        grammar.rollback(1)
        assert grammar.utf8_state == 0


# ---------------------------------------------------------------- upstream helper


@pytest.mark.parametrize("schema, unsupported", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, False),
    ('{"type": "string", "maxLength": 3}', False),
    (True, False),
    ({"not": {"pattern": "^a"}}, True),
    ({"type": "string", "pattern": "(?=a)b"}, True),
    ({"type": "number", "multipleOf": 0.5}, True),
    ('{"type": "integer", "multipleOf": 0.5}', True),
    # Unsatisfiable is not unsupported: compiling it raises instead.
    ({"type": "integer", "minimum": 5, "maximum": 1}, False),
])
def test_has_xgrammar_unsupported_json_features(schema, unsupported: bool) -> None:
    from vllm.v1.structured_output.backend_xgrammar import (
        has_xgrammar_unsupported_json_features,
    )

    assert has_xgrammar_unsupported_json_features(schema) is unsupported


def test_has_xgrammar_unsupported_json_features_bad_input() -> None:
    from vllm.v1.structured_output.backend_xgrammar import (
        has_xgrammar_unsupported_json_features,
    )

    with pytest.raises(ValueError, match="schema: not valid JSON"):
        has_xgrammar_unsupported_json_features("{not json")
    with pytest.raises(ValueError, match="schema: must be a JSON object"):
        has_xgrammar_unsupported_json_features(["type"])  # type: ignore[arg-type]


@pytest.mark.parametrize("name,grammar", [(n, p["grammar"]) for n, p, _ in INVALID
                                          if "grammar" in p])
def test_a_grammar_that_does_not_parse_says_so_in_upstreams_words(
    name: str, grammar: str, backend: XgrammarBackend
) -> None:
    with pytest.raises(ValueError, match="Failed to convert the grammar: "):
        backend.compile_grammar(StructuredOutputsParams(grammar=grammar))
