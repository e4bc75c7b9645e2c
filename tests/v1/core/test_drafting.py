"""Tests for vllm/v1/core/sched/drafting.py: what the scheduler's Drafter proposes, where it
cuts drafts, and the grammar walk of tokens in flight."""

from __future__ import annotations

import numpy as np
import pytest

from tests.v1.core.sched_utils import GRAMMAR_END, FakeGrammar, make_request
from tests.v1.structured_output.test_fast_forward import constrained
from tests.v1.spec_decode.text_grammar import Tokenizer
from vllm.v1.request import Request
from vllm.v1.core.sched.drafting import Drafter, grammar_after
from vllm.v1.metrics.engine_stats import SpecDecodeStats
from vllm.v1.structured_output.fast_forward import FastForward
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
from vllm.v1.spec_decode.proposer import ForcedTokensOnly

# Lookup over [1 2 3 1 2] continues the suffix "1 2" with 3 1 2 (then 3, periodically).
PROMPT = [1, 2, 3, 1, 2]


def _exact() -> FastForward:
    """Exact fast-forward with rows wide enough for FakeGrammar's stop token."""
    return FastForward("exact", Tokenizer,
                       lambda: np.zeros((1, GRAMMAR_END // 32 + 1), dtype=np.int32))


def _drafter(max_model_len: int = 100, num_tokens: int = 3, mode: str = "exact") -> Drafter:
    forcer = _exact() if mode == "exact" else FastForward(mode, Tokenizer)
    return Drafter(NgramProposer(1, 2, num_tokens), max_model_len, forcer)


def _constrained(seq: list[int], jump_forward: bool = False, **params: object) -> Request:
    request = make_request("g", PROMPT, grammar=" ".join(map(str, seq)), **params)
    assert request.structured_output_request is not None
    request.structured_output_request.grammar = FakeGrammar(
        seq, [GRAMMAR_END], 64, jump_forward=jump_forward)
    return request


def test_without_a_proposer_nothing_is_drafted() -> None:
    drafter = Drafter(None, 100)
    request = make_request("r", PROMPT)
    assert not drafter.may_draft(request)
    assert drafter.propose([(request, [])]) == {}
    drafter.release("r")  # nothing kept, nothing to forget


def test_drafts_are_cut_where_the_request_would_stop() -> None:
    assert _drafter().propose([(make_request("r", PROMPT), [])]) == {"r": [3, 1, 2]}
    # max_tokens 3: the step's own token and two drafts.
    assert _drafter().propose([(make_request("r", PROMPT, max_tokens=3), [])]) == {"r": [3, 1]}
    # max_model_len 7: the prompt's 5 tokens, the step's token, one draft.
    assert _drafter(max_model_len=7).propose([(make_request("r", PROMPT), [])]) == {"r": [3]}
    assert _drafter(max_model_len=6).propose([(make_request("r", PROMPT), [])]) == {}


@pytest.mark.parametrize("params", [
    {"presence_penalty": 0.5}, {"logprobs": 1}, {"min_tokens": 1}])
def test_no_drafts_where_sampling_depends_on_more_than_the_tokens(params: dict) -> None:
    request = make_request("r", PROMPT, **params)
    drafter = _drafter()
    assert not drafter.may_draft(request)
    assert drafter.propose([(request, [])]) == {}


def test_a_step_in_flight_is_followed_by_a_dropped_guess() -> None:
    request = make_request("r", PROMPT)
    request.num_output_placeholders = 1  # one step in flight, its drafts assumed [9]
    # The proposal follows PROMPT + [9]; "9" never occurred: nothing to draft.
    assert _drafter().propose([(request, [9])]) == {}
    # With nothing assumed, the proposal's first token (3) guesses the in-flight sample and
    # is dropped; one more is proposed to make up for it.
    assert _drafter().propose([(request, [])]) == {"r": [1, 2, 3]}


def test_constrained_drafts_start_with_forced_tokens_and_stop_at_a_rejected_one() -> None:
    drafter = _drafter()
    # The grammar allows 3, then 1, then 7 alone: they fill the drafts, certain (nothing
    # in flight), and the lookup adds nothing.
    request = _constrained([3, 1, 7])
    assert drafter.propose([(request, [])]) == {"g": [3, 1, 7]}
    assert drafter.num_fast_forward == {"g": 3} == drafter.num_forced
    drafter = _drafter(mode="off")
    request = _constrained([3, 1, 9])
    assert drafter.propose([(request, [])]) == {"g": [3, 1]}  # lookup 3 1 2: 2 refused
    assert drafter.num_fast_forward == {}
    grammar = request.structured_output_request.grammar
    assert grammar.accepted == [] and not grammar.is_terminated()  # left as it was


def test_forced_tokens_only_drafts_for_constrained_requests() -> None:
    drafter = Drafter(ForcedTokensOnly(3), 100, _exact())
    plain = make_request("r", PROMPT)
    constrained = _constrained([4, 5, 6], jump_forward=True)
    assert drafter.propose([(plain, []), (constrained, [])]) == {"g": [4, 5, 6]}


def test_stats_count_verifications() -> None:
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(2, 0)
    assert (stats.num_steps, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)


@pytest.mark.parametrize("jump_forward", [True, False])
def test_grammar_after_the_tokens_in_flight(jump_forward: bool) -> None:
    """grammar_after: the in-flight tokens the grammar accepts (cut at one it refutes, or
    after a stop token), what it forces after them, and the grammar left as it was."""
    grammar = FakeGrammar([1, 2, 3, 4], [GRAMMAR_END], 64, jump_forward=jump_forward)
    assert grammar.accept_tokens("r", [1])
    forced = [3, 4] if jump_forward else []

    def forcer(g: FakeGrammar) -> list[int]:
        return g.jump_forward_tokens()

    assert grammar_after("r", grammar, [2], forcer) == ([2], forced)
    assert grammar_after("r", grammar, [2, 9, 3], forcer) == ([2], forced)  # 9 is refuted
    assert grammar_after("r", grammar, [7], forcer) == ([], [2, 3, 4] if jump_forward else [])
    assert grammar_after("r", grammar, [2, 3, 4, GRAMMAR_END, 5], forcer) == (
        [2, 3, 4, GRAMMAR_END], [])
    assert grammar.accepted == [1] and not grammar.is_terminated()


def _forced_drafter(num_tokens: int = 8) -> Drafter:
    return Drafter(ForcedTokensOnly(num_tokens), 100, FastForward(
        "canonical", Tokenizer, lambda: np.zeros((1, 1), dtype=np.int32)))


@pytest.mark.parametrize("mode, drafts", [
    ("canonical", [1, 2, 3]),  # the tokenizer's '{"' 'name' '":"'
    # Every forced character has two spellings here ('{"' or '{', 'name' or 'n', ...): no
    # position allows a single token, so exact mode has nothing to append.
    ("exact", None),
    ("off", None),
])
def test_each_mode_drafts_its_forced_tokens(mode: str, drafts: list[int] | None) -> None:
    drafter = _forced_drafter(num_tokens=4)
    request = constrained(mode)
    assert drafter.propose([(request, [])]).get("r") == drafts
    assert drafter.num_forced.get("r") == (len(drafts) if drafts else None)


def test_a_canonical_guess_of_the_sample_in_flight_is_dropped_from_the_forced_count() -> None:
    drafter = _forced_drafter()
    request = constrained("canonical")
    request.num_output_placeholders = 1  # its sample in flight is forced: '{"'
    assert drafter.propose([(request, [])]) == {"r": [2, 3]}
    assert drafter.num_forced == {"r": 2}


def test_exact_tokens_after_a_sample_in_flight_are_certain_only_after_certain_drafts() -> None:
    """Async: the in-flight sample is guessed by the same chain that pins nothing (its row
    allows one token), so fast-forward tokens after it are certain; after a proposer's
    in-flight drafts, which a verification may reject, they are only forced."""
    request = _constrained([3, 1, 7])
    request.num_output_placeholders = 1
    drafter = Drafter(ForcedTokensOnly(3), 100, _exact())
    assert drafter.propose([(request, [])]) == {"g": [1, 7, GRAMMAR_END]}  # 3 is the guess
    assert drafter.num_fast_forward == {"g": 3}
    drafter = _drafter()
    assert drafter.propose([(request, [])]) == {"g": [1, 7, GRAMMAR_END]}
    assert drafter.num_forced == {"g": 3} and drafter.num_fast_forward == {}


def test_forced_tokens_kept_are_counted_per_request() -> None:
    drafter = _forced_drafter()
    drafter.record("a", 4, 2, 3)  # 3 of 4 drafts forced, 2 kept
    drafter.record("b", 2, 0, 2)  # nothing kept
    stats = drafter.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (6, 2)
    assert (stats.num_forced_tokens, stats.num_forced_kept_tokens) == (5, 2)
    drafter.release("a")
    drafter.release("b")
    drafter.release("a")  # a second release does not count it again
    assert stats.num_fast_forwarded_requests == 1
    # The record the engine sends is a copy: later counting does not change it.
    snapshot = stats.snapshot()
    stats.record(1, 1, 1)
    assert (snapshot.num_forced_tokens, snapshot.num_forced_kept_tokens,
            snapshot.num_fast_forwarded_requests) == (5, 2, 1)
