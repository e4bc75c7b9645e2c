"""The outlines backend (outlines_core) against the engine's backend contract, with the demo
model's Qwen vocabulary: corpus walks validate, masks never leave the language (equal to
xgrammar's for regexes and choices), refusals name the backend."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from vllm.exceptions import InvalidRequestError, UnsupportedConstraintError
from vllm.sampling_params import StructuredOutputsParams

from tests.v1.structured_output import compat_contract as contract
from tests.v1.structured_output.conftest import EOS_IDS, VOCAB_SIZE
from tests.v1.structured_output.walker import WalkVocab

SPACE, NEWLINE = 220, 198


@pytest.fixture(scope="module")
def outlines_backend(tokenizer: Any) -> Any:
    from vllm.v1.structured_output.backends.outlines import OutlinesBackend

    backend = OutlinesBackend(tokenizer, VOCAB_SIZE, EOS_IDS)
    yield backend
    backend.destroy()


@pytest.mark.slow
def test_corpus_walks_satisfy_the_constraint(
    outlines_backend: Any, tokenizer: Any, walk_vocab: WalkVocab, pieces: list[bytes]
) -> None:
    cases = contract.walkable_cases(("json", "regex", "choice"))
    taken = [c.name for c in cases
             if contract.walk_case(outlines_backend, c, tokenizer, walk_vocab, pieces)]
    # Every regex and choice, and the schemas without numeric bounds.
    assert sum(name.startswith(("regex_", "choice_")) for name in taken) == sum(
        c.name.startswith(("regex_", "choice_")) for c in cases)
    assert sum(name.startswith("json_") for name in taken) >= 20, taken


@pytest.mark.parametrize(
    "constraint",
    [
        {"regex": r"[a-z]{1,6}@\d{2,3}\.(com|org)"},
        {"regex": "(yes|no|maybe)!?"},
        {"regex": "[αβγ]{1,4}-é?"},
        {"choice": ["red", "green", "rede", 'say "hi"']},
        {"json": {"type": "object", "properties": {
            # Unbounded: xgrammar allows no escapes in strings with a length bound.
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "ok": {"type": "boolean"}}, "required": ["name", "ok"]},
         "disable_any_whitespace": True},
    ],
    ids=["regex_email", "regex_alt", "regex_unicode", "choice", "json"],
)
def test_masks_stay_in_the_language(
    constraint: dict[str, Any], outlines_backend: Any, backend: Any, walk_vocab: WalkVocab,
) -> None:
    """Every token outlines allows, xgrammar accepts at the same point. (Not equal: the
    outlines_core index drops tokens that run through a point where the output could end,
    such as "rede" for the choice red|rede, or b"\xc3" of an optional "é".)"""
    params = StructuredOutputsParams(**constraint)
    for seed in (1, 2):
        steps = contract.masks_stay_in_language(outlines_backend, backend, params, walk_vocab, seed)
        assert steps >= 2


def test_matcher_state(outlines_backend: Any, tokenizer: Any) -> None:
    contract.check_matcher_state(outlines_backend, tokenizer)


def test_rollback_past_the_guide_memory(outlines_backend: Any, tokenizer: Any) -> None:
    """Rolling back further than outlines' Guide remembers replays from the start."""
    grammar = outlines_backend.compile_grammar(StructuredOutputsParams(regex="(ab|c)+d"))
    tokens = contract.encode(tokenizer, "ab" * 40 + "c" * 40)
    assert grammar.accept_tokens("r", tokens)
    reference = outlines_backend.compile_grammar(StructuredOutputsParams(regex="(ab|c)+d"))
    assert reference.accept_tokens("r", tokens[:3])
    grammar.rollback(len(tokens) - 3)
    assert grammar.num_processed_tokens == 3
    assert np.array_equal(contract.allowed(grammar), contract.allowed(reference))
    assert grammar.accept_tokens("r", contract.encode(tokenizer, "d") + [EOS_IDS[0]])


def test_batched_fill(outlines_backend: Any, tokenizer: Any) -> None:
    contract.check_batched_fill(outlines_backend, tokenizer)


def test_refusals_name_the_backend(outlines_backend: Any) -> None:
    contract.check_refusals(outlines_backend)
    with pytest.raises(UnsupportedConstraintError, match="ipv4.*outlines"):
        outlines_backend.compile_grammar(
            StructuredOutputsParams(json={"type": "string", "format": "ipv4"}))


def test_special_tokens_are_never_allowed(outlines_backend: Any, tokenizer: Any) -> None:
    # Inside a JSON string nearly any text is allowed (a regex like `.{0,20}` would do too,
    # but its index takes seconds to build).
    for constraint, prefix in [({"json": {"type": "object", "properties": {
                                   "s": {"type": "string"}}}}, '{"s": "ab')]:
        grammar = outlines_backend.compile_grammar(StructuredOutputsParams(**constraint))
        assert grammar.accept_tokens("r", contract.encode(tokenizer, prefix))
        ids = contract.allowed(grammar)
        assert len(ids) > 1000 and contract.forbidden_allowed(ids) == []
        # <think> and <tool_call> are text in this vocabulary, as in xgrammar.
        assert {151657, 151667} <= set(ids.tolist())
    assert outlines_backend.masked_token_ids >= set(range(151669, VOCAB_SIZE)) | {151644}
    assert outlines_backend.masked_token_ids.isdisjoint(EOS_IDS)


def test_whitespace_follows_the_engine_rules(outlines_backend: Any, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def accepts(text: str, **options: Any) -> bool:
        grammar = outlines_backend.compile_grammar(StructuredOutputsParams(json=schema, **options))
        return grammar.accept_tokens("w", contract.encode(tokenizer, text) + [EOS_IDS[0]])

    assert accepts('{"a":1}', disable_any_whitespace=True)
    assert not accepts('{"a": 1}', disable_any_whitespace=True)
    assert accepts('{  "a":  1}', max_whitespace=2)
    assert not accepts('{   "a": 1}', max_whitespace=2)
    assert not accepts(' {"a": 1}', max_whitespace=2) and not accepts('{"a": 1} ', max_whitespace=2)
    assert accepts('{\n"a":\n1\n}', whitespace_pattern="\n?")
    assert not accepts('{ "a":1}', whitespace_pattern="\n?")
    for bad in (r"\s*", "x?"):
        with pytest.raises(InvalidRequestError) as info:
            accepts("{}", whitespace_pattern=bad)
        assert info.value.param == "structured_outputs.whitespace_pattern"
    with pytest.raises(InvalidRequestError) as info:
        accepts("{}", max_whitespace=-1)
    assert info.value.param == "structured_outputs.max_whitespace"
    compact = outlines_backend.compile_grammar(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert compact.accept_tokens("w", contract.encode(tokenizer, "{"))
    assert not {SPACE, NEWLINE} & set(contract.allowed(compact).tolist())


def test_regex_classes_are_ascii(outlines_backend: Any, tokenizer: Any) -> None:
    for regex, good, bad in [(r"\d{3}", "123", "１２３"), (r"\w+", "a_1", "é"),
                             (r"^[\d]+$", "42", "٤٢")]:
        for text, ok in ((good, True), (bad, False)):
            grammar = outlines_backend.compile_grammar(StructuredOutputsParams(regex=regex))
            tokens = contract.encode(tokenizer, text) + [EOS_IDS[0]]
            assert grammar.accept_tokens("a", tokens) == ok, (regex, text)


@pytest.mark.slow
def test_compiles_run_in_the_killable_pool(demo_dir: Any) -> None:
    """A request naming outlines on an `auto` server is checked in the compile pool like any
    other: the worker builds the outlines vocabulary on first use (not counted against the
    deadline), a quick constraint passes, and an index build past the limit (a free-form
    object: seconds over 150k tokens) ends as a clear timeout error, its worker killed."""
    from vllm.config import StructuredOutputsConfig
    from vllm.v1.structured_output.compile_pool import (
        BackendChecker,
        CompileAbortedError,
        CompileCheckPool,
    )

    checker = BackendChecker(str(demo_dir), VOCAB_SIZE, EOS_IDS, StructuredOutputsConfig())
    pool = CompileCheckPool(checker, num_workers=1, timeout_s=1.0)
    try:
        quick = StructuredOutputsParams(choice=["red", "green"], backend="outlines")
        assert pool.submit(quick, small=True).result(120) >= 0.0
        slow = StructuredOutputsParams(json_object=True, backend="outlines")
        with pytest.raises(CompileAbortedError, match="compile_timeout_s"):
            pool.submit(slow, small=False).result(120)
        # The pool goes on after the kill.
        assert pool.submit(quick, small=True).result(120) >= 0.0
    finally:
        pool.shutdown()


def test_draft_rows(outlines_backend: Any, tokenizer: Any) -> None:
    contract.check_draft_rows(outlines_backend, tokenizer)
