"""A request's token edits in the post-layer function's fixed form: the tokens it may sample
as packed rows (shaped like a grammar bitmask), and its logit_bias as a padded row."""

from __future__ import annotations

import numpy as np
import pytest

from vllm import SamplingParams
from vllm.v1.worker.token_rules import allowed_rows, bias_row, stop_bans

VOCAB = 70  # three words per row, the last one partly past the vocabulary


def _allowed(row: np.ndarray) -> set[int]:
    """The token ids a packed row allows (below VOCAB)."""
    bits = (row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return {int(t) for t in np.flatnonzero(bits.reshape(-1)) if t < VOCAB}


def _params(**fields) -> SamplingParams:
    params = SamplingParams(**fields)
    params.update_from_model([0])  # token 0 is EOS
    return params


def test_allowed_rows_at_any_position_and_while_min_tokens_holds() -> None:
    everything = set(range(VOCAB))
    rows = allowed_rows(_params(), VOCAB, 3)
    assert rows.dtype == np.int32 and rows.shape == (2, 3)
    assert _allowed(rows[0]) == _allowed(rows[1]) == everything
    # Allowed ids (500 is outside the vocabulary: dropped); bit 31 is an int32 word's sign.
    rows = allowed_rows(_params(allowed_token_ids=[3, 31, 40, 500]), VOCAB, 3)
    assert _allowed(rows[0]) == _allowed(rows[1]) == {3, 31, 40}
    # One-token bad words always; EOS and the stop ids (99 is outside) while min_tokens
    # holds; a bad word of two tokens is not a ban here.
    rows = allowed_rows(_params(bad_words_token_ids=[[31], [63], [5, 6]], min_tokens=2,
                                stop_token_ids=[7, 99]), VOCAB, 3)
    assert _allowed(rows[0]) == everything - {31, 63}
    assert _allowed(rows[1]) == everything - {0, 7, 31, 63}
    rows = allowed_rows(_params(allowed_token_ids=[0, 3, 7], min_tokens=1), VOCAB, 3)
    assert _allowed(rows[0]) == {0, 3, 7} and _allowed(rows[1]) == {3, 7}
    assert stop_bans(_params(stop_token_ids=[7]), VOCAB) == []  # no min_tokens: no ban


def test_bias_row_pads_with_entries_that_add_nothing() -> None:
    ids, values = bias_row(_params(logit_bias={4: 1.5, 9: -100, 2: 0.1}), 5)
    assert ids.dtype == np.int64 and values.dtype == np.float32
    assert ids.tolist() == [4, 9, 2, 0, 0]
    assert values.tolist() == [1.5, -100.0, np.float32(0.1), 0.0, 0.0]
    ids, values = bias_row(_params(), 2)
    assert ids.tolist() == [0, 0] and values.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="logit_bias"):
        bias_row(_params(logit_bias={1: 1.0, 2: 1.0}), 1)
