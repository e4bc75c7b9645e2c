"""Tests for vllm/v1/core/sched/postprocess.py: stop checks and appending sampled tokens."""

from __future__ import annotations

from tests.v1.core.sched_utils import EOS, GRAMMAR_END, FakeGrammar, make_request
from vllm.exceptions import ErrorKind
from vllm.v1.core.sched.postprocess import append_output_tokens, check_stop
from vllm.v1.request import Request, RequestStatus


def _after(request: Request, *tokens: int) -> Request:
    request.append_output_token_ids(list(tokens))
    return request


def test_a_plain_token_does_not_stop() -> None:
    request = _after(make_request("r", 4), 7)
    assert not check_stop(request, 100)
    assert request.status == RequestStatus.WAITING and request.stop_reason is None


def test_eos_stops_once_min_tokens_are_out() -> None:
    assert not check_stop(_after(make_request("r", 4, min_tokens=2), EOS), 100)
    request = _after(make_request("r", 4, min_tokens=2), 7, EOS)
    assert check_stop(request, 100)
    # EOS is not a user stop token: no stop_reason.
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None


def test_a_user_stop_token_is_the_stop_reason() -> None:
    request = _after(make_request("r", 4, stop_token_ids=[9]), 9)
    assert check_stop(request, 100)
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == 9


def test_length_caps() -> None:
    request = _after(make_request("r", 4, max_tokens=2), 7, 8)
    assert check_stop(request, 100) and request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    request = _after(make_request("r", 4), 7, 8)
    assert check_stop(request, 6) and request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # A stop token on the last allowed position is a stop, not a cap.
    request = _after(make_request("r", 4, max_tokens=1), EOS)
    assert check_stop(request, 5) and request.status == RequestStatus.FINISHED_STOPPED


def test_a_terminated_grammar_stops() -> None:
    grammar = FakeGrammar([5], [GRAMMAR_END], 64)
    request = _after(make_request("r", 4), 5)
    assert grammar.accept_tokens("r", [5]) and not check_stop(request, 100, grammar)
    assert grammar.accept_tokens("r", [GRAMMAR_END]) and grammar.is_terminated()
    request.append_output_token_ids([GRAMMAR_END])
    assert check_stop(request, 100, grammar) and request.status == RequestStatus.FINISHED_STOPPED


def test_append_keeps_tokens_up_to_the_first_stop() -> None:
    request = make_request("r", 4, stop_token_ids=[9])
    assert append_output_tokens(request, [7, 9, 8], 100) == [7, 9]
    assert request.output_token_ids == [7, 9] and request.stop_reason == 9


def test_append_refuses_a_token_the_grammar_rejects() -> None:
    request = make_request("g", 4, grammar="5 6")
    assert request.structured_output_request is not None
    request.structured_output_request.grammar = FakeGrammar([5, 6], [GRAMMAR_END], 64)
    assert append_output_tokens(request, [5, 7], 100) == [5]
    assert request.output_token_ids == [5]
    assert request.status == RequestStatus.FINISHED_ERROR
    assert request.error_kind == ErrorKind.INTERNAL
    assert request.error_message == "sampled token 7 was rejected by the request's grammar"
