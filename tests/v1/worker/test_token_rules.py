"""Token edits in the post-layer function's fixed form: bans as cleared bitmask bits beside the
grammar's, logit_bias as flat entries."""

from __future__ import annotations

import numpy as np

from vllm import SamplingParams
from vllm.v1.worker.token_rules import banned_ids, bias_entries, masked_rows

VOCAB = 70  # three words per row, the last one partly past the vocabulary


def _allowed(row: np.ndarray) -> set[int]:
    """The token ids a packed row allows (below VOCAB)."""
    bits = (row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return {int(t) for t in np.flatnonzero(bits.reshape(-1)) if t < VOCAB}


def test_bans_clear_bits_beside_the_grammars() -> None:
    params = [
        SamplingParams(allowed_token_ids=[3, 31, 40, 500]),  # 500: outside, ignored
        SamplingParams(bad_words_token_ids=[[31], [63], [5, 6]], min_tokens=2,
                       stop_token_ids=[0, 99]),
        SamplingParams(),
        SamplingParams(min_tokens=1, stop_token_ids=[7]),  # run out at position 1
    ]
    for p in params:
        p.update_from_model([])
    grammar = np.zeros((3, 3), dtype=np.int32)
    grammar[0] = [-1, 0, 0]  # tokens 0..31
    grammar[2] = [0, 1 << 8, 0]  # token 40 only
    bitmask, rows = masked_rows(params, [1, 1, 1, 1], VOCAB, 3, grammar, [0, 2])
    assert rows == [0, 1, 2]
    assert _allowed(bitmask[0]) == {3, 31}  # grammar and allowed ids both hold
    # Bit 31 is an int32 word's sign; ids past the vocabulary are dropped; a bad word of two
    # tokens is not a ban here.
    assert _allowed(bitmask[1]) == set(range(VOCAB)) - {0, 31, 63}
    assert _allowed(bitmask[2]) == {40}  # the grammar's row, untouched
    assert grammar[0].tolist() == [-1, 0, 0]  # the grammar's array is not modified
    assert banned_ids(params[1], 2, VOCAB) == [31, 63]  # min_tokens reached
    assert masked_rows(params[2:], [1, 1], VOCAB, 3, None, []) == (None, [])


def test_bias_entries_are_one_per_row_and_token() -> None:
    params = [SamplingParams(logit_bias={4: 1.5, 9: -100}), SamplingParams(),
              SamplingParams(logit_bias={4: 0.1})]
    entries = bias_entries(params)
    assert entries["bias_rows"].tolist() == [0, 0, 2]
    assert entries["bias_ids"].tolist() == [4, 9, 4]
    assert entries["bias_values"].dtype == np.float32
    assert entries["bias_values"].tolist() == [1.5, -100.0, np.float32(0.1)]
    assert bias_entries(params[1:2]) is None
