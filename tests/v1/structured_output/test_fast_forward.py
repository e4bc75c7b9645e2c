"""Tests for vllm/v1/structured_output/fast_forward.py: the modes, the admission rule, and the
canonical tokenization of forced text."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.v1.core.sched_utils import GRAMMAR_END, FakeGrammar, make_request
from tests.v1.spec_decode.text_grammar import TextGrammar, Tokenizer
from vllm.config import StructuredOutputsConfig
from vllm.exceptions import InvalidRequestError
from vllm.options import parse_fast_forward
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.request import Request
from vllm.v1.structured_output.fast_forward import (
    FastForward,
    check_request_mode,
    only_token,
    server_mode,
)

OPTIONS = ['{"name":"x"}', '{"name":"y"}']


def constrained(mode: str | None, options: list[str] = OPTIONS) -> Request:
    """A request with a TextGrammar over `options` asking for fast-forward `mode`."""
    request = make_request("r", [1, 2, 3])
    request.sampling_params.structured_outputs = StructuredOutputsParams(
        regex="x", fast_forward=mode)
    request = Request("r", [1, 2, 3], request.sampling_params)
    assert request.structured_output_request is not None
    request.structured_output_request.grammar = TextGrammar(options)
    return request


@pytest.mark.parametrize("value, mode", [
    ("off", "off"), ("exact", "exact"), ("canonical", "canonical"),
    (True, "exact"), (False, "off"), ("true", "exact"), ("false", "off"),
])
def test_modes_and_their_boolean_spellings(value: object, mode: str) -> None:
    assert parse_fast_forward(value, "f") == mode
    assert StructuredOutputsConfig(fast_forward=value).fast_forward == mode
    assert StructuredOutputsParams(json={}, fast_forward=value).fast_forward == mode


@pytest.mark.parametrize("value", ["fast", "", 1, "Exact", ["exact"]])
def test_a_bad_mode_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="--structured-outputs-config.fast_forward: must be"):
        StructuredOutputsConfig(fast_forward=value)
    with pytest.raises(InvalidRequestError, match="must be one of off, exact, canonical") as e:
        StructuredOutputsParams(json={}, fast_forward=value)
    assert e.value.param == "structured_outputs.fast_forward"


def test_the_default_is_off_and_a_request_follows_the_server() -> None:
    assert StructuredOutputsConfig().fast_forward == "off"
    assert StructuredOutputsParams(json={}).fast_forward is None
    forcer = FastForward("canonical", Tokenizer)
    assert forcer.mode(constrained(None)) == "canonical"
    assert forcer.mode(constrained("exact")) == "exact"
    assert forcer.mode(constrained("off")) == "off"
    assert forcer.mode(make_request("u", [1, 2])) == "off"  # unconstrained
    # A mode above the server's is clamped (admission refuses it before it gets here).
    assert FastForward("exact", Tokenizer).mode(constrained("canonical")) == "exact"


def test_server_mode_counts_speculative_decoding_as_exact() -> None:
    def config(mode: str, spec: object) -> SimpleNamespace:
        return SimpleNamespace(structured_outputs_config=StructuredOutputsConfig(
            fast_forward=mode), speculative_config=spec)

    assert server_mode(config("off", None)) == "off"
    assert server_mode(config("off", object())) == "exact"  # drafts start with forced tokens
    assert server_mode(config("canonical", object())) == "canonical"


@pytest.mark.parametrize("allowed, refused", [
    ("off", ["exact", "canonical"]), ("exact", ["canonical"]), ("canonical", [])])
def test_a_request_may_ask_for_at_most_the_servers_mode(allowed: str, refused: list) -> None:
    for mode in (None, "off", "exact", "canonical"):
        if mode in refused:
            with pytest.raises(InvalidRequestError, match=f"'{mode}' is not enabled") as e:
                check_request_mode(mode, allowed)
            assert e.value.param == "structured_outputs.fast_forward"
        else:
            check_request_mode(mode, allowed)


def test_canonical_tokens_are_the_tokenizers_spelling_of_the_forced_text() -> None:
    grammar = TextGrammar(OPTIONS)
    forcer = FastForward("canonical", Tokenizer)
    # '{"name":"' longest match first; the backend's own spelling is one character each.
    assert forcer.canonical_tokens(grammar, 8) == [1, 2, 3]
    assert grammar.jump_forward_tokens()[:3] == [5, 4, 6]
    assert forcer.canonical_tokens(grammar, 2) == [1, 2]
    assert forcer.canonical_tokens(grammar, 0) == []
    assert grammar.tokens == []  # left as it was
    assert grammar.accept_tokens("r", [1, 2, 3, 11])
    # After the choice only '"}' is forced.
    assert forcer.canonical_tokens(grammar, 8) == [13]
    grammar.accept_tokens("r", [13, 0])
    assert forcer.canonical_tokens(grammar, 8) == []  # terminated


def test_nothing_forced_gives_nothing() -> None:
    grammar = TextGrammar(['{"a"', "}"])
    assert FastForward("canonical", Tokenizer).canonical_tokens(grammar, 8) == []


def test_a_spelling_the_grammar_refuses_falls_back_to_the_backends_tokens() -> None:
    # A tokenizer that starts every encoding with a piece the grammar does not allow.
    forcer = FastForward("canonical", lambda: Tokenizer(prefix=[15]))
    grammar = TextGrammar(OPTIONS)
    assert forcer.canonical_tokens(grammar, 4) == grammar.jump_forward_tokens()[:4]


def test_the_tokenizer_is_loaded_once_and_only_when_needed() -> None:
    loads = []

    def load() -> Tokenizer:
        loads.append(1)
        return Tokenizer()

    forcer = FastForward("canonical", load)
    assert forcer.canonical_tokens(TextGrammar(["a", "b"]), 4) == []
    assert loads == []
    forcer.canonical_tokens(TextGrammar(OPTIONS), 4)
    forcer.canonical_tokens(TextGrammar(OPTIONS), 4)
    assert loads == [1]


def test_only_token_reads_a_single_bit_row() -> None:
    row = np.zeros(3, dtype=np.int32)
    assert only_token(row) is None
    row[2] = np.int32(-(2**31))  # bit 31 of word 2: token 95
    assert only_token(row) == 95
    row[0] = 1
    assert only_token(row) is None  # two tokens
    row[:] = 0
    row[1] = 6  # tokens 33 and 34
    assert only_token(row) is None


def test_single_tokens_are_those_allowed_alone_and_end_after_a_stop() -> None:
    forcer = FastForward("exact", lambda: None,
                         lambda: np.zeros((1, GRAMMAR_END // 32 + 1), dtype=np.int32))
    grammar = FakeGrammar([4, 9], [GRAMMAR_END], 64)
    assert forcer.single_tokens("r", grammar, 2) == [4, 9]
    assert forcer.single_tokens("r", grammar, 8) == [4, 9, GRAMMAR_END]
    assert grammar.accepted == [] and not grammar.is_terminated()  # left as it was
    assert forcer.single_tokens("r", grammar, 0) == []
    # Two stop tokens at the end: a choice, so the run ends before it.
    assert forcer.single_tokens("r", FakeGrammar([4], [GRAMMAR_END, 1], 64), 8) == [4]


def test_single_tokens_stop_where_the_grammar_allows_a_choice() -> None:
    forcer = FastForward("exact", lambda: None, lambda: np.zeros((1, 1), dtype=np.int32))
    grammar = TextGrammar(OPTIONS)
    assert forcer.single_tokens("r", grammar, 8) == []  # '{"' or '{'
    assert grammar.tokens == []
