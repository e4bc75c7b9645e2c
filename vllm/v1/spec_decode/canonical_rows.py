"""Canonical fast-forward in the bitmask: a forced position allows its canonical token only.

In canonical mode (fast_forward.py) a position where the grammar forces text is not the
model's choice: its bitmask row allows exactly one token, so the sample is that token and a
forced draft there is always kept. That holds for the rows of forced drafts (the draft
itself) and for the row after the step's last draft (the first canonical token of what the
grammar then forces, if anything). The latter keeps a stale draft right under async
scheduling: the drafter guesses the in-flight sample with the same function of the grammar
state that pinned its row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from vllm.options import CANONICAL
from vllm.v1.structured_output.fast_forward import FastForward

if TYPE_CHECKING:
    from vllm.v1.request import Request


def pin(bitmask: np.ndarray, row: int, token: int) -> None:
    """Makes `bitmask[row]` allow `token` only, in place."""
    words = bitmask.view(np.uint32)
    words[row] = 0
    words[row, token // 32] = np.uint32(1 << (token % 32))


def pin_canonical_rows(
    fast_forward: FastForward,
    requests: dict[str, Request],
    req_ids: list[str],
    drafts: dict[str, list[int]],
    num_forced: dict[str, int],
    bitmask: np.ndarray,
    skip: dict[str, int] | None = None,
) -> int:
    """Pins the forced rows of the canonical-mode requests among `req_ids`, laid out in
    `bitmask` as StructuredOutputManager.grammar_bitmask lays them out (1 + drafts rows
    each, less `skip[id]` certain fast-forward tokens, which have none and need no pin). A
    reply that may still open a thinking block is left alone (its first token may be
    `<think>`). Returns how many rows were pinned. Every grammar is left as it was.

    Only drafts the grammar accepts from its current state are pinned: a stale draft that
    assumed tokens which did not come must not be forced into the output."""
    skip = skip or {}
    pinned = 0
    first = 0
    for req_id in req_ids:
        request = requests[req_id]
        tokens = drafts.get(req_id, [])
        skipped = skip.get(req_id, 0)
        # Row j + skipped of the request's positions; the skipped ones have no row.
        row, first = first - skipped, first + 1 + len(tokens) - skipped
        structured_req = request.structured_output_request
        if (
            structured_req is None
            or structured_req.grammar is None
            or structured_req.undecided
            or fast_forward.mode(request) != CANONICAL
        ):
            continue
        grammar = structured_req.grammar
        valid = grammar.validate_tokens(tokens)
        forced = min(num_forced.get(req_id, 0), len(valid))
        for j in range(skipped, forced):
            pin(bitmask, row + j, valid[j])
        pinned += max(0, forced - skipped)
        if len(valid) < len(tokens) or not grammar.accept_tokens(req_id, valid):
            continue
        try:
            after = fast_forward.canonical_tokens(grammar, 1)
        finally:
            grammar.rollback(len(valid))
        if after:
            pin(bitmask, row + len(tokens), after[0])
            pinned += 1
    return pinned
