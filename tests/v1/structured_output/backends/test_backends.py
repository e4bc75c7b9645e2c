"""Both structured-output backends (xgrammar, llguidance) against the same contract and
independent oracles, with the demo model's Qwen vocabulary."""

from __future__ import annotations

import codecs
import dataclasses
import os
import time
import zlib
from typing import Any

import numpy as np
import pytest

from vllm.exceptions import (
    GrammarCompileError,
    InvalidRequestError,
    UnsupportedConstraintError,
)
from vllm.sampling_params import StructuredOutputsParams

from tests.v1.structured_output.conftest import EOS_IDS, VOCAB_SIZE
from tests.v1.structured_output.schemas import ALL_CASES, Case
from tests.v1.structured_output.walker import WalkVocab, allowed_token_ids, random_walk

# Qwen's special tokens (151643..151656) and the ids past its tokenizer (151669..) are never
# text; its other added tokens (<tool_call> 151657 ... <think> 151667, </think> 151668) are.
SPECIAL_IDS = frozenset(range(151_643, 151_657))
TOKENIZER_END = 151_669
SPACE, NEWLINE, TAB = 220, 198, 197
WORDS = (VOCAB_SIZE + 31) // 32

# Cases both backends enforce (llguidance refuses propertyNames and minProperties beside
# optional properties), kept small so that each backend walks them in seconds.
_WALK_NAMES = [
    "json_flat_person",
    "json_nested_address",
    "json_int_array",
    "json_object_array",
    "json_anyof_variants",
    "json_defs_point",
    "json_const_escapes",
    "json_nullable_int",
    "json_mixed_enum",
    "json_tuple_items",
    "json_recursive_tree",
    "json_unicode_enum",
    "json_float_range",
    "json_zip_plus4",
    "json_bounded_string",
    "json_oneof_disjoint",
    "json_explicit_closed",
    "json_string_schema",
    "json_object",
    "regex_phone",
    "regex_ipv4_like",  # \d must be ASCII: Python's re may not know every Unicode digit
    "regex_email_like",
    "regex_decimal",
    "regex_greek",
    "regex_date",
    "choice_escapes",
    "choice_unicode",
    "choice_with_empty",
    "choice_prefixes",
    "grammar_arithmetic",
    "grammar_balanced",
    "grammar_csv_row",
    "grammar_lark_items",
    "structural_tag_legacy_triggers",
    "structural_tag_sequence_json_string",
]
WALK_CASES = [c for c in ALL_CASES if c.name in _WALK_NAMES]
WALK_MAX_WHITESPACE = 4


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def backend_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def any_backend(backend_name: str, request: pytest.FixtureRequest) -> Any:
    """The session backend of `backend_name` (built once per test session)."""
    return request.getfixturevalue("backend" if backend_name == "xgrammar" else "guidance_backend")


def _rng(name: str, salt: int) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()) * 7 + salt)


def _allowed(grammar: Any) -> np.ndarray:
    bitmask = np.zeros((1, WORDS), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 0)
    return allowed_token_ids(bitmask[0], VOCAB_SIZE)


def _forbidden_allowed(ids: np.ndarray) -> list[int]:
    """Allowed ids that are Qwen special tokens (other than stops) or past the tokenizer."""
    return [int(i) for i in ids
            if (i in SPECIAL_IDS or i >= TOKENIZER_END) and i not in EOS_IDS]


def _whitespace_runs_outside_strings(text: str) -> list[int]:
    """Lengths of the whitespace runs between JSON tokens."""
    runs: list[int] = []
    run = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c.isspace():
            run += 1
            continue
        elif c == '"':
            in_string = True
        if run:
            runs.append(run)
            run = 0
    return runs + ([run] if run else [])


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _accepts_whole(
    backend: Any, params: StructuredOutputsParams, tokenizer: Any, text: str
) -> bool:
    """True when a fresh grammar accepts `text` followed by a stop token."""
    grammar = backend.compile_grammar(params)
    return grammar.accept_tokens("whole", _encode(tokenizer, text) + [EOS_IDS[0]])


# ---------------------------------------------------------------------------- random walks


def test_walk_cases_exist() -> None:
    assert len(WALK_CASES) == len(_WALK_NAMES)


@pytest.mark.parametrize("case", WALK_CASES, ids=lambda c: c.name)
def test_random_walks_satisfy_the_constraint(
    case: Case, any_backend: Any, tokenizer: Any, walk_vocab: WalkVocab, pieces: list[bytes]
) -> None:
    json_kind = "json" in case.params or "json_object" in case.params
    for compact in (False, True) if json_kind else (False,):
        options: dict[str, Any] = {"disable_any_whitespace": compact}
        if json_kind and not compact:
            options["max_whitespace"] = WALK_MAX_WHITESPACE
        params = case.make_params(**options)
        grammar = any_backend.compile_grammar(params)
        tokens, stopped = random_walk(grammar, walk_vocab, _rng(case.name, compact))
        assert stopped, f"walk did not finish: {tokenizer.decode(tokens)!r}"
        assert grammar.is_terminated() and tokens[-1] in EOS_IDS
        body = tokens[:-1]
        assert not _forbidden_allowed(np.array(body, dtype=np.int64)), body
        text = tokenizer.decode(body, skip_special_tokens=False)
        case.check(text)
        b"".join(pieces[t] for t in body).decode("utf-8")  # strict: raises on invalid UTF-8
        if json_kind:
            runs = _whitespace_runs_outside_strings(text)
            assert max(runs, default=0) <= (0 if compact else WALK_MAX_WHITESPACE), text
        fresh = any_backend.compile_grammar(params)
        assert fresh.accept_tokens("fresh", tokens)
        assert fresh.is_terminated() and fresh.num_processed_tokens == len(tokens)


# ---------------------------------------------------------------------------- matcher state


def test_accept_reject_validate_rollback(any_backend: Any, tokenizer: Any) -> None:
    grammar = any_backend.compile_grammar(StructuredOutputsParams(regex="abc[0-9]{2}"))
    ids = [_encode(tokenizer, c)[0] for c in "abc12"]
    wrong = _encode(tokenizer, "z")[0]
    start = _allowed(grammar)

    assert grammar.validate_tokens(ids[:2] + [wrong] + ids[2:]) == ids[:2]
    assert grammar.validate_tokens(ids + [EOS_IDS[0], wrong]) == ids + [EOS_IDS[0]]
    assert grammar.validate_tokens(ids[:3] + [EOS_IDS[0]]) == ids[:3]  # not complete yet
    assert grammar.num_processed_tokens == 0 and np.array_equal(_allowed(grammar), start)

    assert not grammar.accept_tokens("r", ids[:2] + [wrong, ids[2]])
    assert grammar.num_processed_tokens == 2  # the prefix stays; the rejected token does not
    after_two = _allowed(grammar)
    assert grammar.accept_tokens("r", ids[2:4])
    grammar.rollback(2)
    assert grammar.num_processed_tokens == 2 and np.array_equal(_allowed(grammar), after_two)
    with pytest.raises(ValueError, match="rollback"):
        grammar.rollback(3)
    with pytest.raises(ValueError, match="rollback"):
        grammar.rollback(-1)
    assert grammar.num_processed_tokens == 2

    assert grammar.accept_tokens("r", ids[2:] + [EOS_IDS[1]])
    assert grammar.is_terminated() and grammar.num_processed_tokens == 6
    grammar.rollback(0)
    assert grammar.is_terminated()
    grammar.rollback(grammar.num_processed_tokens)
    assert grammar.num_processed_tokens == 0 and np.array_equal(_allowed(grammar), start)


def test_jump_forward_tokens_spell_the_forced_text(any_backend: Any, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"title": {"type": "string"},
                                               "score": {"type": "integer"}},
              "required": ["title", "score"], "additionalProperties": False}
    grammar = any_backend.compile_grammar(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert grammar.accept_tokens("r", _encode(tokenizer, '{"title":"ab"'))
    before = _allowed(grammar)
    forced = grammar.jump_forward_tokens()
    # Only `,"score":` can follow; the backend may stop early, never go past it.
    text = tokenizer.decode(forced)
    assert text and ',"score":'.startswith(text), text
    assert grammar.validate_tokens(forced) == forced
    assert grammar.num_processed_tokens == len(_encode(tokenizer, '{"title":"ab"'))
    assert np.array_equal(_allowed(grammar), before)
    # A choice point forces nothing.
    free = any_backend.compile_grammar(StructuredOutputsParams(regex="[a-z]+"))
    assert free.jump_forward_tokens() == []
    assert grammar.accept_tokens("r", _encode(tokenizer, ',"score":1}') + [EOS_IDS[0]])
    assert grammar.jump_forward_tokens() == []  # terminated


def test_forced_string_is_the_forced_text_in_whole_characters(
    any_backend: Any, tokenizer: Any
) -> None:
    schema = {"type": "object", "properties": {"title": {"type": "string"},
                                               "größe": {"enum": ["éa", "èb"]}},
              "required": ["title", "größe"], "additionalProperties": False}
    grammar = any_backend.compile_grammar(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert grammar.accept_tokens("r", _encode(tokenizer, '{"title":"ab"'))
    before = _allowed(grammar)
    # Everything up to the enum's opening quote is forced; é and è share their first byte,
    # which is not a whole character, so the text stops before it.
    assert grammar.forced_string() == ',"größe":"'
    assert np.array_equal(_allowed(grammar), before)
    assert grammar.num_processed_tokens == len(_encode(tokenizer, '{"title":"ab"'))
    free = any_backend.compile_grammar(StructuredOutputsParams(regex="[a-z]+"))
    assert free.forced_string() == ""
    assert grammar.accept_tokens("r", _encode(tokenizer, ',"größe":"éa"}') + [EOS_IDS[0]])
    assert grammar.forced_string() == ""  # terminated


@pytest.mark.parametrize(
    "data, text",
    [(b"ab", "ab"), ("aé".encode(), "aé"), ("aé".encode()[:2], "a"),
     ("é".encode()[1:] + b"a", ""), (b"a\xffb", "a"), (b"", "")],
    ids=["ascii", "whole", "cut_last", "starts_inside", "invalid", "empty"],
)
def test_guidance_forced_bytes_become_whole_characters(data: bytes, text: str) -> None:
    from vllm.v1.structured_output.backends.guidance import _whole_characters

    assert _whole_characters(data) == text


def test_rejected_tokens_leave_the_state_unchanged(any_backend: Any, tokenizer: Any) -> None:
    # llguidance enters an unrecoverable error state when it consumes a token it rejects; a
    # rejection must never do that (nor change anything else).
    grammar = any_backend.compile_grammar(StructuredOutputsParams(regex="abc[0-9]{2}"))
    ids = [_encode(tokenizer, c)[0] for c in "abc12"]
    assert grammar.accept_tokens("r", ids[:2])
    before = _allowed(grammar)
    rejected = [
        _encode(tokenizer, "z")[0],  # not in the grammar
        ids[3],  # a digit, too early
        EOS_IDS[0],  # stop before the output is complete
        EOS_IDS[1],
        151644,  # <|im_start|>
        151667,  # <think>
        151700,  # past the tokenizer, inside the lm head
        VOCAB_SIZE - 1,
        VOCAB_SIZE + 5,  # past the vocabulary
        -1,
    ]
    for token in rejected:
        assert not grammar.accept_tokens("r", [token]), token
        assert grammar.validate_tokens([token]) == [], token
        assert grammar.num_processed_tokens == 2
        assert np.array_equal(_allowed(grammar), before), token
    assert grammar.accept_tokens("r", ids[2:] + [EOS_IDS[0]])
    assert grammar.is_terminated()


def test_only_stop_tokens_after_a_complete_value(any_backend: Any, tokenizer: Any) -> None:
    for params, text in [
        (StructuredOutputsParams(json={"type": "boolean"}), "true"),
        (StructuredOutputsParams(json_object=True, max_whitespace=2), '{"k": [1, {}]}'),
        (StructuredOutputsParams(regex="ab"), "ab"),
        (StructuredOutputsParams(choice=["yes", "no"]), "no"),
    ]:
        grammar = any_backend.compile_grammar(params)
        assert grammar.accept_tokens("r", _encode(tokenizer, text)), text
        assert sorted(_allowed(grammar).tolist()) == sorted(EOS_IDS), text
        assert not grammar.is_terminated()
        assert not grammar.accept_tokens("r", [SPACE])
        assert grammar.accept_tokens("r", [EOS_IDS[1]])
        assert grammar.is_terminated()


def test_termination(any_backend: Any, tokenizer: Any) -> None:
    grammar = any_backend.compile_grammar(StructuredOutputsParams(choice=["a", "ab", "abc"]))
    assert grammar.accept_tokens("r", _encode(tokenizer, "ab"))
    allowed = set(_allowed(grammar).tolist())
    assert set(EOS_IDS) <= allowed and _encode(tokenizer, "c")[0] in allowed
    assert grammar.accept_tokens("r", [EOS_IDS[0]])
    assert grammar.is_terminated()

    bitmask = np.zeros((3, WORDS), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 1)
    assert (bitmask[1] == -1).all() and (bitmask[0] == 0).all() and (bitmask[2] == 0).all()
    for token in (_encode(tokenizer, "c")[0], EOS_IDS[0], EOS_IDS[1]):
        assert not grammar.accept_tokens("r", [token])
        assert grammar.validate_tokens([token]) == []
    assert grammar.num_processed_tokens == 2

    grammar.rollback(1)
    assert not grammar.is_terminated()
    assert set(_allowed(grammar).tolist()) == allowed
    assert grammar.accept_tokens("r", _encode(tokenizer, "c") + [EOS_IDS[1]])
    assert grammar.is_terminated() and grammar.num_processed_tokens == 3


# ---------------------------------------------------------------------------- bitmasks


@pytest.mark.parametrize("batch", [5, 70], ids=["small", "parallel"])
def test_batched_fill_equals_per_row_fill(
    batch: int, any_backend: Any, tokenizer: Any
) -> None:
    prompts = [
        ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, '{"a": '),
        ({"json_object": True}, '{"k'),
        ({"regex": "[a-z]{2,5}-[0-9]+"}, "ab"),
        ({"choice": ["red", "green"]}, "gre"),
        ({"grammar": 'root ::= "(" root ")" | "x"'}, "(("),
        ({"regex": "ab"}, "ab"),  # only stop tokens
    ]
    grammars = []
    for i in range(batch):
        params, prefix = prompts[i % len(prompts)]
        grammar = any_backend.compile_grammar(StructuredOutputsParams(**params))
        assert grammar.accept_tokens("r", _encode(tokenizer, prefix[: 1 + i % len(prefix)]))
        grammars.append(grammar)
    terminated = any_backend.compile_grammar(StructuredOutputsParams(regex="x"))
    assert terminated.accept_tokens("r", _encode(tokenizer, "x") + [EOS_IDS[0]])
    grammars.append(terminated)

    rows = np.random.default_rng(batch).permutation(len(grammars) + 7)[: len(grammars)]
    sentinel = np.int32(0x5A5A5A5A)
    bitmask = np.full((len(grammars) + 7, WORDS), sentinel, dtype=np.int32)
    any_backend.fill_bitmasks(grammars, bitmask, rows.tolist())
    for grammar, row in zip(grammars, rows):
        single = np.zeros((1, WORDS), dtype=np.int32)
        grammar.fill_bitmask(single, 0)
        assert np.array_equal(bitmask[row], single[0]), row
        if grammar is not terminated:
            assert not _forbidden_allowed(allowed_token_ids(bitmask[row], VOCAB_SIZE))
    assert (bitmask[rows[-1]] == -1).all()
    untouched = sorted(set(range(len(bitmask))) - set(rows.tolist()))
    assert len(untouched) == 7 and (bitmask[untouched] == sentinel).all()


def test_bitmask_layout(any_backend: Any, tokenizer: Any) -> None:
    # Bit j of word w allows token 32w + j: decoded here with shifts, not np.unpackbits.
    grammar = any_backend.compile_grammar(StructuredOutputsParams(choice=["x"]))
    bitmask = any_backend.allocate_token_bitmask(2)
    assert bitmask.shape == (2, WORDS) and bitmask.dtype == np.int32 and (bitmask == -1).all()
    grammar.fill_bitmask(bitmask, 1)
    words = bitmask[1].view(np.uint32)
    ids = [32 * w + j for w in np.flatnonzero(words) for j in range(32) if words[w] >> j & 1]
    assert ids == [_encode(tokenizer, "x")[0]]


def test_special_tokens_are_never_allowed(any_backend: Any, tokenizer: Any) -> None:
    # At positions where nearly any text is allowed, Qwen's control tokens and the ids past
    # the tokenizer stay masked.
    cases = [
        ({"json": {"type": "object", "properties": {"s": {"type": "string"}}}}, '{"s": "ab'),
        ({"json_object": True}, '{"k": "v'),
        ({"regex": ".{0,20}"}, "hi "),
        ({"grammar": 'root ::= [^"]*'}, "x"),
        ({"grammar": 'start: /[^"]*/'}, "x"),
        ({"choice": ["<|im_start|>", "<think>"]}, "<"),
    ]
    for params, prefix in cases:
        grammar = any_backend.compile_grammar(StructuredOutputsParams(**params))
        assert grammar.accept_tokens("r", _encode(tokenizer, prefix)), params
        allowed = _allowed(grammar)
        assert _forbidden_allowed(allowed) == [], params
        for control in (151644, 151646, 151656, 151700, VOCAB_SIZE - 1):
            assert not grammar.accept_tokens("r", [control])
    assert any_backend.masked_token_ids >= set(range(151669, VOCAB_SIZE)) | {151644, 151656}
    assert any_backend.masked_token_ids.isdisjoint(range(151657, 151669))
    assert any_backend.masked_token_ids.isdisjoint(EOS_IDS)


def test_added_tokens_that_are_not_special_are_text(backend: Any, tokenizer: Any) -> None:
    """<think> and <tool_call> decode to their text, so a string may hold them and a choice
    of that text may be written as the single token. (llguidance reads every added token as
    special, so it never allows them there: stricter; a structural tag names them.)"""
    any_backend = backend
    grammar = any_backend.compile_grammar(
        StructuredOutputsParams(json={"type": "object", "properties": {"s": {"type": "string"}}}))
    assert grammar.accept_tokens("r", _encode(tokenizer, '{"s": "'))
    assert {151657, 151667, 151668} <= set(_allowed(grammar).tolist())
    choice = any_backend.compile_grammar(StructuredOutputsParams(choice=["<think>ok"]))
    assert choice.accept_tokens("r", [151667, *_encode(tokenizer, "ok"), EOS_IDS[0]])
    assert choice.is_terminated()


def test_structural_tag_triggers_on_the_tool_call_token(any_backend: Any, tokenizer: Any) -> None:
    """Hermes tool calls: free text until the model writes the <tool_call> token, then the
    call's JSON, then free text again."""
    backend = any_backend
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    tag = {"structures": [{"begin": '<tool_call>\n{"name": "f", "arguments": ',
                           "schema": schema, "end": "}\n</tool_call>"}],
           "triggers": ["<tool_call>"]}
    grammar = backend.compile_grammar(StructuredOutputsParams(structural_tag=tag))
    assert grammar.accept_tokens("r", _encode(tokenizer, "Let me look."))
    assert 151657 in set(_allowed(grammar).tolist())
    assert grammar.accept_tokens("r", [151657])
    assert not grammar.accept_tokens("r", _encode(tokenizer, "hello"))
    body = '\n{"name": "f", "arguments": {"a": 1}}\n'
    assert grammar.accept_tokens("r", [*_encode(tokenizer, body), 151658])
    assert grammar.accept_tokens("r", _encode(tokenizer, " Done."))


def test_draft7_tuple_items_are_enforced_by_llguidance(guidance_backend: Any,
                                                      tokenizer: Any) -> None:
    """normalize_json_schema writes draft-07's `items: [...]` as `prefixItems`; llguidance
    read that as an unknown keyword while the schema still said draft-07."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
              "items": [{"const": "a"}], "additionalItems": False, "minItems": 1}
    for text, ok in (('["a"]', True), ('["b"]', False), ('["a","a"]', False)):
        grammar = guidance_backend.compile_grammar(StructuredOutputsParams(json=schema))
        assert grammar.accept_tokens("t", _encode(tokenizer, text) + [EOS_IDS[0]]) == ok, text


def test_lark_special_token_reference_is_masked(guidance_backend: Any, tokenizer: Any) -> None:
    # llguidance's Lark can name a special token; the backend still never allows it.
    grammar_text = 'start: "x" | <|im_start|> "y"'
    grammar = guidance_backend.compile_grammar(StructuredOutputsParams(grammar=grammar_text))
    assert 151644 not in _allowed(grammar)
    for size in (1, 70):  # one row, and a batch large enough for the parallel fill
        # Distinct grammars: one matcher may not appear twice in a parallel fill.
        batch = [grammar] + [
            guidance_backend.compile_grammar(StructuredOutputsParams(grammar=grammar_text))
            for _ in range(size - 1)
        ]
        bitmask = np.zeros((size, WORDS), dtype=np.int32)
        guidance_backend.fill_bitmasks(batch, bitmask, list(range(size)))
        assert not (bitmask[:, 151644 // 32] >> (151644 % 32) & 1).any()
    assert not grammar.accept_tokens("r", [151644])
    assert grammar.accept_tokens("r", _encode(tokenizer, "x") + [EOS_IDS[0]])
    with pytest.raises(GrammarCompileError, match="accepts no output"):
        guidance_backend.compile_grammar(StructuredOutputsParams(grammar="start: <|im_start|>"))


def test_parallel_fill_in_a_forked_process(guidance_backend: Any, tokenizer: Any) -> None:
    # Compile workers are forked from a process whose executor threads already ran; the
    # child has none of them, so reusing that executor there would wait forever.
    grammars = [
        guidance_backend.compile_grammar(StructuredOutputsParams(regex="[a-z]{1,4}"))
        for _ in range(70)
    ]
    expected = guidance_backend.allocate_token_bitmask(70)
    guidance_backend.fill_bitmasks(grammars, expected, list(range(70)))  # starts the threads
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only when the fill finished and matched
        status = 1
        try:
            child = guidance_backend.allocate_token_bitmask(70)
            guidance_backend.fill_bitmasks(grammars, child, list(range(70)))
            status = 0 if np.array_equal(child, expected) else 2
        finally:
            os._exit(status)
    deadline = time.monotonic() + 60  # a hang, not a speed limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the parallel fill in the forked process never finished")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


# UTF-8 lead bytes whose next byte is restricted, with a forbidden and an allowed next byte.
_RESTRICTED = [(0xE0, 0x80, 0xA0), (0xED, 0xA0, 0x80), (0xF0, 0x80, 0x90), (0xF4, 0x90, 0x80)]


@pytest.mark.parametrize(
    "params,prefix",
    [
        ({"json": {"type": "string", "maxLength": 8}}, '"'),
        ({"regex": ".{1,8}"}, ""),
        ({"grammar": "root ::= [^a]*"}, ""),
    ],
    ids=["max_length", "regex", "grammar"],
)
def test_outputs_stay_valid_utf8(
    params: dict[str, Any], prefix: str, any_backend: Any, tokenizer: Any, pieces: list[bytes]
) -> None:
    by_byte = {piece[0]: idx for idx, piece in enumerate(pieces) if len(piece) == 1}
    start = _encode(tokenizer, prefix) if prefix else []
    for lead, bad_next, good_next in _RESTRICTED:
        grammar = any_backend.compile_grammar(StructuredOutputsParams(**params))
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


# ---------------------------------------------------------------------------- whitespace


def set_option(monkeypatch: pytest.MonkeyPatch, backend: Any, **changes: Any) -> None:
    """Changes engine-wide options of a (shared) backend for this test only."""
    monkeypatch.setattr(backend, "options", dataclasses.replace(backend.options, **changes))


def test_compact_json_forbids_whitespace(
    any_backend: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}}
    steps = ["{", '"a"', ":", "1", ","]
    for compact, engine_wide in [(False, False), (True, False), (False, True)]:
        set_option(monkeypatch, any_backend, disable_any_whitespace=engine_wide)
        grammar = any_backend.compile_grammar(
            StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
        )
        expect_whitespace = not (compact or engine_wide)
        for piece in steps:
            assert grammar.accept_tokens("r", _encode(tokenizer, piece))
            allowed = set(_allowed(grammar).tolist())
            assert expect_whitespace == bool({SPACE, NEWLINE, TAB} & allowed), (compact, piece)


# Every place JSON allows whitespace: W is replaced by a run at one place at a time.
_WHITESPACE_TEMPLATE = '{W"a"W:W[W1W,W2W]W,W"b"W:W{W"c"W:WtrueW}W,W"d"W:W{W}W,W"e"W:W[W]W}'
_WHITESPACE_SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "array", "items": {"type": "integer"}},
        "b": {"type": "object", "properties": {"c": {"type": "boolean"}}},
        "d": {"type": "object", "properties": {}},
        "e": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["a", "b", "d", "e"],
}


def _with_run_at(place: int, run: str) -> str:
    parts = _WHITESPACE_TEMPLATE.split("W")
    return "".join(p + (run if i == place else "") for i, p in enumerate(parts[:-1])) + parts[-1]


@pytest.mark.parametrize("limit", [0, 1, 3])
def test_max_whitespace_bounds_every_run(limit: int, any_backend: Any, tokenizer: Any) -> None:
    params = StructuredOutputsParams(json=_WHITESPACE_SCHEMA, max_whitespace=limit)
    grammar = any_backend.compile_grammar(params)
    places = _WHITESPACE_TEMPLATE.count("W")
    mixed = ("\t\n \r" * limit)[:limit]
    for place in range(places):
        for run, ok in [(" " * limit, True), (mixed, True), (" " * (limit + 1), False)]:
            grammar.rollback(grammar.num_processed_tokens)
            text = _with_run_at(place, run)
            tokens = _encode(tokenizer, text) + [EOS_IDS[0]]
            assert grammar.accept_tokens("ws", tokens) == ok, (place, text)
    # Never before or after the value.
    for text in [" " + _with_run_at(0, ""), _with_run_at(0, "") + " "]:
        assert not _accepts_whole(any_backend, params, tokenizer, text), text


def test_engine_max_whitespace_and_request_override(
    any_backend: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_option(monkeypatch, any_backend, max_whitespace=2)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    two, three = '{  "a": 1}', '{   "a": 1}'
    engine = StructuredOutputsParams(json=schema)
    assert _accepts_whole(any_backend, engine, tokenizer, two)
    assert not _accepts_whole(any_backend, engine, tokenizer, three)
    wider = StructuredOutputsParams(json=schema, max_whitespace=3)
    assert _accepts_whole(any_backend, wider, tokenizer, three)
    set_option(monkeypatch, any_backend, max_whitespace=None)
    assert _accepts_whole(any_backend, engine, tokenizer, "{" + " " * 40 + '"a": 1}')


def test_structural_tag_schemas_are_bounded_and_exact(
    backend_name: str, any_backend: Any, tokenizer: Any
) -> None:
    """A JSON schema inside a structural tag gets the whitespace bound and the exact-semantics
    checks of a plain `json` constraint (it used to get neither)."""
    backend = any_backend
    def tag(schema: Any, **options: Any) -> StructuredOutputsParams:
        return StructuredOutputsParams(structural_tag={
            "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
            "triggers": ["<f>"]}, **options)

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for limit, text, ok in [(2, '<f>{  "a": 1}</f>', True), (2, '<f>{   "a": 1}</f>', False),
                            (0, '<f>{"a":1}</f>', True), (0, '<f>{ "a":1}</f>', False)]:
        grammar = backend.compile_grammar(tag(schema, max_whitespace=limit))
        assert grammar.accept_tokens("t", _encode(tokenizer, text)) == ok, (limit, text)
    bounded = tag({"type": "string", "pattern": "^a+$", "maxLength": 3})
    if backend_name == "xgrammar":
        # xgrammar cannot bound a pattern of a group's length: refused, not silently weakened
        # (one of one-character atoms is folded into one pattern, below).
        with pytest.raises(UnsupportedConstraintError):
            backend.compile_grammar(tag({"type": "string", "pattern": "^(ab)+$",
                                         "maxLength": 3}))
    for text, ok in [('<f>"aaa"</f>', True), ('<f>"aaaa"</f>', False)]:
        grammar = backend.compile_grammar(bounded)
        assert grammar.accept_tokens("t", _encode(tokenizer, text)) == ok, text


def test_structural_tag_text_never_holds_a_bare_trigger(
    any_backend: Any, tokenizer: Any
) -> None:
    """Free text ends at a trigger written as characters too: the tag must follow it."""
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f="],
        "tags": [{"type": "tag", "begin": "<f=a>",
                  "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
                  "end": "</f>"}]}}
    for text, ok in [("hi <f=a>12</f> ok", True), ("hi <f=b>", False), ("hi <f=a>x", False),
                     ("no tags at all", True)]:
        grammar = any_backend.compile_grammar(StructuredOutputsParams(structural_tag=tag))
        tokens = _encode(tokenizer, text) + [EOS_IDS[0]]
        assert grammar.accept_tokens("t", tokens) == ok, text
    stop_first = {**tag, "format": {**tag["format"], "stop_after_first": True}}
    grammar = any_backend.compile_grammar(StructuredOutputsParams(structural_tag=stop_first))
    assert grammar.accept_tokens("t", _encode(tokenizer, "x <f=a>1</f>"))
    assert sorted(_allowed(grammar).tolist()) == sorted(EOS_IDS)


def test_whitespace_pattern(guidance_backend: Any, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def accepts(pattern: str, text: str) -> bool:
        params = StructuredOutputsParams(json=schema, whitespace_pattern=pattern)
        return _accepts_whole(guidance_backend, params, tokenizer, text)

    # Each place holds nothing or one match of the pattern.
    assert accepts("\n?", '{\n"a":\n1\n}') and accepts("\n?", '{"a":1}')
    assert not accepts("\n?", '{ "a":1}') and not accepts("\n?", '{\n\n"a":1}')
    assert accepts("[ ]{2}", '{  "a"  :  1  }') and not accepts("[ ]{2}", '{ "a":1}')
    for bad in [r"\s*", ".", "x?", "[^a]", "$"]:
        with pytest.raises(InvalidRequestError) as info:
            guidance_backend.compile_grammar(
                StructuredOutputsParams(json=schema, whitespace_pattern=bad)
            )
        assert info.value.param == "structured_outputs.whitespace_pattern"


# ---------------------------------------------------------------------------- choices


def test_choices_with_metacharacters(any_backend: Any, tokenizer: Any) -> None:
    choices = [
        "a|b", "(x)", "[a-z]", ".*", 'say "hi"', "back\\slash", "/x/", "%ignore x", "\\d",
        "it's", '{"k": 1}', "start: x", "a\nb",
    ]
    grammar = any_backend.compile_grammar(StructuredOutputsParams(choice=choices))
    for member in choices:
        grammar.rollback(grammar.num_processed_tokens)
        assert grammar.accept_tokens("r", _encode(tokenizer, member) + [EOS_IDS[0]]), member
        assert grammar.is_terminated()
    for outsider in ["a", "b", "x", "q", "(x", ".", "say hi", "back\\\\slash", "5", "a|b|", "ab"]:
        grammar.rollback(grammar.num_processed_tokens)
        assert not grammar.accept_tokens("r", _encode(tokenizer, outsider) + [EOS_IDS[0]]), outsider


def test_regex_classes_are_ascii(any_backend: Any, tokenizer: Any) -> None:
    # \d and \w mean ASCII in both backends (as in JSON-schema patterns).
    for regex, good, bad in [(r"\d{3}", "123", "１２３"), (r"\w+", "a_1", "é")]:
        params = StructuredOutputsParams(regex=regex)
        assert _accepts_whole(any_backend, params, tokenizer, good)
        assert not _accepts_whole(any_backend, params, tokenizer, bad)


# ---------------------------------------------------------------------------- JSON semantics


def test_additional_properties(backend_name: str, any_backend: Any, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    extra = '{"a": 1, "b": 2}'
    closed = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    assert not _accepts_whole(any_backend, closed, tokenizer, extra)
    assert _accepts_whole(any_backend, closed, tokenizer, '{"a": 1}')
    # Without the option: xgrammar's strict mode never generates unlisted properties;
    # llguidance follows JSON Schema, where they are allowed.
    opened = StructuredOutputsParams(json=schema)
    assert _accepts_whole(any_backend, opened, tokenizer, extra) == (backend_name == "guidance")


# ---------------------------------------------------------------------------- refusals


def _message_is_clean(e: InvalidRequestError, field: str, *, one_line: bool = True) -> None:
    text = str(e)
    assert text.startswith(f"structured_outputs.{field}: "), text
    assert len(e.message) <= 500 and "<state>" not in text and "/project/" not in text, text
    # xgrammar's Lark errors end with an excerpt and a caret line, on purpose.
    assert not one_line or "\n" not in text, text


@pytest.mark.parametrize(
    "params,fragment",
    [
        # With minItems 2, uniqueItems cannot become maxItems 1 (normalize_json_schema).
        ({"json": {"type": "array", "uniqueItems": True, "minItems": 2}}, "'uniqueItems'"),
        ({"json": {"type": "string", "not": {"pattern": "^a"}}}, "'not'"),
        ({"json": {"type": "array", "items": {"type": "string"},
                                "contains": {"const": "x"}, "maxContains": 1}}, "'contains'"),
        # (uri-reference and uri-template become a pattern of valid characters.)
        ({"json": {"type": "string", "format": "json-pointer"}}, "'json-pointer'"),
        # A pattern and a length at once cannot become one patternProperties regex.
        ({"json": {"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 3}}},
         "'propertyNames'"),
        (
            {"json": {"x-guidance": {"lenient": True}, "type": "string",
                      "not": {"pattern": "^a"}}},
            "'not'",
        ),
        ({"regex": "(?!x)a"}, "look-around"),
        ({"regex": r"(a)\1"}, "backreferences"),
        ({"structural_tag": {"type": "structural_tag", "format": {"type": "any_text"}}},
         "'any_text'"),
        ({"grammar": 'root ::= "a" (= "b")'}, "EBNF"),
        ({"grammar": 'start: "x" <[5]>'}, "<[...]>"),
        ({"grammar": '%llguidance {"allow_invalid_utf8": true}\nstart: "x"'}, "%llguidance"),
        ({"grammar": 'start: "x" y\ny[stop="END"]: /[a-z]*/'}, "stop="),
    ],
    ids=[
        "unique_items", "not", "contains", "unknown_format", "property_names", "x_guidance",
        "lookahead", "backreference", "structural_tag", "ebnf_lookahead", "token_ids",
        "llguidance_options", "stop_attribute",
    ],
)
def test_guidance_refuses_what_it_cannot_enforce(
    params: dict[str, Any], fragment: str, guidance_backend: Any
) -> None:
    with pytest.raises(UnsupportedConstraintError) as info:
        guidance_backend.compile_grammar(StructuredOutputsParams(**params))
    _message_is_clean(info.value, next(iter(params)))
    assert fragment in info.value.message
    assert "llguidance" in info.value.message


@pytest.mark.parametrize(
    "params,fragment",
    [
        ({"regex": "a(b"}, ""),
        ({"regex": "[z-a]"}, ""),
        ({"grammar": "this is not a grammar"}, ""),
        ({"grammar": 'start: start "a"'}, "can never finish"),
        ({"json": {"type": "string", "minLength": 5, "maxLength": 2}}, "minLength"),
        ({"json": "[1, 2]"}, "must be a JSON object"),
    ],
    ids=["unclosed_group", "bad_range", "lark_syntax", "stuck_lark", "length", "not_object"],
)
def test_invalid_constraints_raise_compile_errors(
    params: dict[str, Any], fragment: str, backend_name: str, any_backend: Any
) -> None:
    with pytest.raises(GrammarCompileError) as info:
        any_backend.compile_grammar(StructuredOutputsParams(**params))
    assert not isinstance(info.value, UnsupportedConstraintError), info.value
    _message_is_clean(info.value, next(iter(params)), one_line=backend_name == "guidance")
    assert fragment in info.value.message


def test_ebnf_is_converted_for_guidance(guidance_backend: Any, tokenizer: Any) -> None:
    params = StructuredOutputsParams(grammar='root ::= "x" [0-9]{1,3} ("!" | "?")')
    assert _accepts_whole(guidance_backend, params, tokenizer, "x123?")
    assert not _accepts_whole(guidance_backend, params, tokenizer, "x1234?")


@pytest.mark.parametrize("grammar", ["this is not a grammar", "start: (\"a\""])
def test_a_grammar_that_does_not_parse_is_reported_in_upstreams_words(
    any_backend: Any, grammar: str
) -> None:
    """Lark text neither backend parses: a 400 naming the field, upstream's wording first."""
    with pytest.raises(ValueError) as info:
        any_backend.compile_grammar(StructuredOutputsParams(grammar=grammar))
    message = str(info.value)
    assert message.startswith("structured_outputs.grammar"), message
    assert "Failed to convert the grammar" in message, message
