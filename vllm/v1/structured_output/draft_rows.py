"""Bitmask rows beyond each request's own: draft positions and a possible `<think>`."""

from __future__ import annotations

import logging

import numpy as np

from vllm.v1.structured_output.backends.base import StructuredOutputGrammar

logger = logging.getLogger(__name__)


def skip_forced(req_id: str, grammar: StructuredOutputGrammar, tokens: list[int]) -> int:
    """Accepts a request's exact fast-forward tokens (they get no bitmask row) and returns
    how many it accepted, for the caller to roll back. They were each the only token their
    position allowed when drafted, so a refusal is a bug: it is logged, and the rows that
    follow are filled from where the grammar stopped."""
    before = grammar.num_processed_tokens
    if tokens and not grammar.accept_tokens(req_id, tokens):
        logger.error("request %s: its grammar refused a fast-forward token of %s",
                     req_id, tokens)
    return grammar.num_processed_tokens - before


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
