"""Tests for vllm/v1/spec_decode/canonical_rows.py: which bitmask rows canonical
fast-forward pins, to which token, and which it leaves alone."""

from __future__ import annotations

import numpy as np
import pytest

from tests.v1.structured_output.test_fast_forward import constrained
from tests.v1.spec_decode.text_grammar import VOCAB_SIZE, Tokenizer
from vllm.reasoning import ReasoningState
from vllm.v1.spec_decode.canonical_rows import pin, pin_canonical_rows
from vllm.v1.structured_output.fast_forward import FastForward

WORDS = (VOCAB_SIZE + 31) // 32


def _allowed(bitmask: np.ndarray, row: int) -> list[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


@pytest.mark.parametrize("token", [0, 5, 31, 32, 63])
def test_pin_allows_exactly_one_token(token: int) -> None:
    bitmask = np.full((2, 2), -1, dtype=np.int32)
    pin(bitmask, 1, token)
    assert _allowed(bitmask, 1) == [token]
    assert _allowed(bitmask, 0) == list(range(64))  # other rows untouched


def _rows(requests: dict, drafts: dict, forced: dict, skip: dict | None = None
          ) -> tuple[np.ndarray, int]:
    skip = skip or {}
    num_rows = sum(1 + len(drafts.get(r, ())) - skip.get(r, 0) for r in requests)
    bitmask = np.full((num_rows, WORDS), -1, dtype=np.int32)
    pinned = pin_canonical_rows(FastForward("canonical", Tokenizer), requests, list(requests),
                                drafts, forced, bitmask, skip)
    return bitmask, pinned


def test_forced_drafts_and_the_forced_row_after_them_are_pinned() -> None:
    canonical = constrained("canonical")
    exact = constrained("exact")
    requests = {"c": canonical, "e": exact}
    # c drafts '{"' 'name' (forced) and its grammar then forces '":"' (token 3).
    bitmask, pinned = _rows(requests, {"c": [1, 2], "e": [1]}, {"c": 2, "e": 1})
    assert pinned == 3
    assert [_allowed(bitmask, r) for r in range(3)] == [[1], [2], [3]]
    # The exact-mode request's rows are the grammar's (untouched here).
    assert _allowed(bitmask, 3) == _allowed(bitmask, 4) == list(range(VOCAB_SIZE))
    assert canonical.structured_output_request.grammar.tokens == []  # left as it was


def test_a_draft_that_is_not_forced_is_verified_not_pinned() -> None:
    request = constrained("canonical")
    # One forced draft, then a proposer's guess: its row stays the grammar's.
    bitmask, pinned = _rows({"c": request}, {"c": [1, 2]}, {"c": 1})
    assert _allowed(bitmask, 0) == [1]
    assert _allowed(bitmask, 1) == list(range(VOCAB_SIZE))
    assert _allowed(bitmask, 2) == [3]  # the grammar forces after the drafts: canonical


def test_stale_drafts_the_grammar_refuses_are_never_forced() -> None:
    request = constrained("canonical")
    # Drafted one step stale after a token that did not come: the grammar refuses them.
    bitmask, pinned = _rows({"c": request}, {"c": [3, 11]}, {"c": 2})
    assert pinned == 0
    assert all(_allowed(bitmask, r) == list(range(VOCAB_SIZE)) for r in range(3))


def test_a_choice_point_is_left_to_the_model() -> None:
    request = constrained("canonical")
    request.structured_output_request.grammar.accept_tokens("r", [1, 2, 3])
    bitmask, pinned = _rows({"c": request}, {}, {})
    assert pinned == 0 and _allowed(bitmask, 0) == list(range(VOCAB_SIZE))


def test_a_reply_that_may_open_a_thinking_block_is_not_pinned() -> None:
    request = constrained("canonical")
    request.structured_output_request.reasoning = ReasoningState.UNDECIDED
    bitmask, pinned = _rows({"c": request}, {}, {})
    assert pinned == 0 and _allowed(bitmask, 0) == list(range(VOCAB_SIZE))
    request.structured_output_request.reasoning = ReasoningState.ENDED
    bitmask, pinned = _rows({"c": request}, {}, {})
    assert pinned == 1 and _allowed(bitmask, 0) == [1]


def test_certain_drafts_have_no_row_and_the_rows_after_them_are_pinned() -> None:
    """Forced drafts scheduled as certain (fast-forward tokens) get no bitmask row: the
    runner samples nothing there. The rows that remain keep their pins, shifted up."""
    canonical = constrained("canonical")
    exact = constrained("exact")
    requests = {"e": exact, "c": canonical}
    bitmask, pinned = _rows(requests, {"e": [1], "c": [1, 2]}, {"e": 1, "c": 2},
                            {"e": 1, "c": 1})
    assert bitmask.shape[0] == 1 + 2
    assert _allowed(bitmask, 0) == list(range(VOCAB_SIZE))  # e's row after its draft
    assert [_allowed(bitmask, r) for r in (1, 2)] == [[2], [3]]  # c: 'name', then '":"'
    assert pinned == 2
