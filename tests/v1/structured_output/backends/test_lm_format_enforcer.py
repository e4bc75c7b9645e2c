"""The lm-format-enforcer backend against the engine's backend contract, with the demo
model's Qwen vocabulary: corpus walks validate, masks never leave the language, and what the
library gets wrong is refused or masked."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from vllm.exceptions import UnsupportedConstraintError
from vllm.sampling_params import StructuredOutputsParams

from tests.v1.structured_output import compat_contract as contract
from tests.v1.structured_output.conftest import EOS_IDS, VOCAB_SIZE
from tests.v1.structured_output.walker import WalkVocab

SPACE, NEWLINE = 220, 198


@pytest.fixture(scope="module")
def lmfe_backend(tokenizer: Any) -> Any:
    from vllm.v1.structured_output.backends.lm_format_enforcer import LMFormatEnforcerBackend

    backend = LMFormatEnforcerBackend(tokenizer, VOCAB_SIZE, EOS_IDS)
    yield backend
    backend.destroy()


def test_corpus_walks_satisfy_the_constraint(
    lmfe_backend: Any, tokenizer: Any, walk_vocab: WalkVocab, pieces: list[bytes]
) -> None:
    cases = contract.walkable_cases(("json", "regex", "choice"))
    taken = [c.name for c in cases
             if contract.walk_case(lmfe_backend, c, tokenizer, walk_vocab, pieces)]
    assert sum(name.startswith(("regex_", "choice_")) for name in taken) == sum(
        c.name.startswith(("regex_", "choice_")) for c in cases)
    # Numbers and maxLength are refused (the library gets both wrong), so fewer JSON cases.
    assert sum(name.startswith("json_") for name in taken) >= 10, taken


@pytest.mark.parametrize(
    "constraint",
    [
        {"regex": r"[a-z]{1,6}@\d{2,3}\.(com|org)"},
        {"choice": ["red", "green", "rede", 'say "hi"']},
        # One property per object: the library takes properties in any order, the
        # reference only in schema order (both valid).
        {"json": {"type": "object", "properties": {"rows": {
            "type": "array", "maxItems": 3, "items": {
                "type": "object", "properties": {"name": {"type": "string"}},
                "required": ["name"]}}}, "required": ["rows"]},
         "disable_any_whitespace": True},
    ],
    ids=["regex", "choice", "json"],
)
def test_masks_stay_in_the_language(
    constraint: dict[str, Any], lmfe_backend: Any, backend: Any, walk_vocab: WalkVocab
) -> None:
    """Every token lm-format-enforcer allows, xgrammar allows at the same point."""
    params = StructuredOutputsParams(**constraint)
    assert contract.masks_stay_in_language(lmfe_backend, backend, params, walk_vocab, 3) >= 2


def test_no_raw_control_characters_in_strings(lmfe_backend: Any, tokenizer: Any) -> None:
    """The library's free-text shortcut allowed tokens holding a newline inside a JSON
    string (an output json.loads rejects); the backend masks them there."""
    schema = {"type": "object", "properties": {"note": {"type": "string", "minLength": 1}}}
    grammar = lmfe_backend.compile_grammar(StructuredOutputsParams(json=schema))
    assert grammar.accept_tokens("s", contract.encode(tokenizer, '{"note": "ab'))
    ids = contract.allowed(grammar)
    texts = [tokenizer.decode([int(i)]) for i in ids if int(i) not in EOS_IDS]
    assert len(texts) > 1000
    assert not [t for t in texts if "\\" in t or any(ord(c) < 0x20 for c in t)]


def test_matcher_state(lmfe_backend: Any, tokenizer: Any) -> None:
    contract.check_matcher_state(lmfe_backend, tokenizer)


def test_batched_fill(lmfe_backend: Any, tokenizer: Any) -> None:
    contract.check_batched_fill(lmfe_backend, tokenizer)


@pytest.mark.parametrize(
    "schema,fragment",
    [
        ({"type": "string", "format": "date"}, "'format'"),
        ({"type": "object", "properties": {"v": {"const": 2}}}, "'const'"),
        ({"enum": ["a", 1]}, "'enum'"),
        ({"const": 'a"b'}, "'const'"),
        ({"type": ["string", "null"], "minLength": 5}, "list of types"),
        ({"type": "array", "prefixItems": [{"type": "integer"}]}, "'prefixItems'"),
    ],
    ids=["format", "int_const", "mixed_enum", "escaped_const", "type_list", "prefix_items"],
)
def test_what_the_library_gets_wrong_is_refused(
    schema: dict[str, Any], fragment: str, lmfe_backend: Any
) -> None:
    with pytest.raises(UnsupportedConstraintError) as info:
        lmfe_backend.compile_grammar(StructuredOutputsParams(json=schema))
    assert fragment in info.value.message and "lm-format-enforcer" in info.value.message


def test_refusals_name_the_backend(lmfe_backend: Any) -> None:
    contract.check_refusals(lmfe_backend)
    with pytest.raises(UnsupportedConstraintError, match="whitespace_pattern"):
        lmfe_backend.compile_grammar(StructuredOutputsParams(
            json={"type": "object"}, whitespace_pattern="\n?"))


def test_wide_regexes_are_refused(lmfe_backend: Any) -> None:
    """A wide class makes every step walk the whole vocabulary through the regex automaton
    character by character (minutes for `.{0,20}`): refused before anything is built."""
    for regex in (".{0,20}", "[^a]+", r"\S+", "[\u0000-\uffff]", r"\W"):
        with pytest.raises(UnsupportedConstraintError, match="lm-format-enforcer") as info:
            lmfe_backend.compile_grammar(StructuredOutputsParams(regex=regex))
        assert info.value.param == "structured_outputs.regex"


def test_special_and_partial_tokens_are_never_allowed(
    lmfe_backend: Any, tokenizer: Any, pieces: list[bytes]
) -> None:
    grammar = lmfe_backend.compile_grammar(StructuredOutputsParams(
        json={"type": "object", "properties": {"s": {"type": "string"}}}))
    assert grammar.accept_tokens("r", contract.encode(tokenizer, '{"s": "ab'))
    ids = contract.allowed(grammar)
    assert len(ids) > 1000 and contract.forbidden_allowed(ids) == []
    for idx in ids:
        if int(idx) not in EOS_IDS:
            pieces[int(idx)].decode("utf-8")  # whole characters only
    assert lmfe_backend.masked_token_ids >= set(range(151669, VOCAB_SIZE)) | {151644, 127}


def test_whitespace(lmfe_backend: Any, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}

    def accepts(text: str, **options: Any) -> bool:
        grammar = lmfe_backend.compile_grammar(StructuredOutputsParams(json=schema, **options))
        return grammar.accept_tokens("w", contract.encode(tokenizer, text) + [EOS_IDS[0]])

    assert accepts('{"a":true}', disable_any_whitespace=True)
    assert not accepts('{"a": true}', disable_any_whitespace=True)
    assert accepts('{  "a":  true}', max_whitespace=2)
    assert not accepts('{   "a": true}', max_whitespace=2)
    compact = lmfe_backend.compile_grammar(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert compact.accept_tokens("w", contract.encode(tokenizer, "{"))
    assert not {SPACE, NEWLINE} & set(contract.allowed(compact).tolist())
    assert not np.isin(contract.allowed(compact), EOS_IDS).any()


def test_draft_rows(lmfe_backend: Any, tokenizer: Any) -> None:
    contract.check_draft_rows(lmfe_backend, tokenizer)


def test_memory_per_token_stays_small(lmfe_backend: Any, tokenizer: Any) -> None:
    """The library keeps every prefix's allowed-token list (the whole vocabulary in free
    text: ~1.4 MB per token, 90 MB after 65 tokens); the grammar keeps none of them and only
    the rows near its position, and still answers after a rollback."""
    grammar = lmfe_backend.compile_grammar(
        StructuredOutputsParams(json={"type": "object", "properties": {"s": {"type": "string"}}}))
    tokens = contract.encode(tokenizer, '{"s": "' + "hello world " * 10)
    for token in tokens:
        assert grammar.accept_tokens("m", [token])
        contract.allowed(grammar)
    states = grammar._enforcer.prefix_states.values()
    assert sum(s.allowed_tokens is not None for s in states) == 0
    assert len(grammar._rows) <= 6
    before = contract.allowed(grammar)
    grammar.rollback(12)  # past the rows kept: recomputed from the library's parser state
    assert len(contract.allowed(grammar)) > 1000
    assert grammar.accept_tokens("m", tokens[-12:])
    assert np.array_equal(contract.allowed(grammar), before)


def test_a_library_failure_fails_only_the_request(
    lmfe_backend: Any, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception inside the library mid-output must not escape the engine's bitmask
    step: the row allows nothing, so the sampled token is rejected and the request fails."""
    grammar = lmfe_backend.compile_grammar(StructuredOutputsParams(regex="[a-c]{1,5}"))
    assert grammar.accept_tokens("f", contract.encode(tokenizer, "a"))

    def boom(tokens: list[int]) -> Any:
        raise RuntimeError("library bug")

    monkeypatch.setattr(grammar._enforcer, "get_allowed_tokens", boom)
    assert not contract.row_of(grammar).any()
    assert not grammar.accept_tokens("f", contract.encode(tokenizer, "b"))
    assert grammar.num_processed_tokens == 1
