"""Bitmask rows beyond each request's own: draft positions and a possible `<think>`."""

from __future__ import annotations

import numpy as np

from vllm.v1.structured_output.backend_types import StructuredOutputGrammar


def fill_draft_rows(
    req_id: str,
    grammar: StructuredOutputGrammar,
    drafts: list[int],
    bitmask: np.ndarray,
    first: int,
) -> None:
    """Fills rows first+1 .. first+len(drafts): the masks after each draft in turn, by
    accepting the drafts and rolling them back (the grammar ends as it was).

    Drafts proposed one step stale (async scheduling) assumed tokens that may not have
    come, so the grammar may reject one. Rows from the first rejected draft on allow every
    token: the target's sample at the row before it is masked correctly and cannot equal the
    rejected draft, so verification stops there and never reads them."""
    valid = grammar.validate_tokens(drafts)
    accepted = 0
    try:
        for j, token in enumerate(valid, start=1):
            if not grammar.accept_tokens(req_id, [token]):
                break  # validate_tokens said it would: a backend bug, logged there
            accepted += 1
            grammar.fill_bitmask(bitmask, first + j)
    finally:
        grammar.rollback(accepted)
    bitmask[first + accepted + 1 : first + len(drafts) + 1] = -1


def allow_think(bitmask: np.ndarray, rows: list[int], start_id: int) -> None:
    """Also allows token `start_id` (`<think>`) in `rows` of `bitmask`, in place."""
    word = bitmask[:, start_id // 32].view(np.uint32)
    word[rows] |= np.uint32(1 << (start_id % 32))
