"""A request's token edits in the fixed form the post-layer function reads (request_slots.py).

Every edit that forbids tokens (allowed_token_ids, one-token bad words, the min_tokens ban of
the stop tokens) becomes a cleared bit in a packed row shaped like a grammar bitmask. A
forbidden logit is -inf whichever edit set it, and a bias added to -inf leaves -inf, so the
logits come out as the Sampler's, which applies the same edits in its own order (grammar,
allowed ids, bad words, bias, min_tokens ban). logit_bias becomes a fixed-width row of
(token id, value) entries, padded with entries that add 0 to token 0.

Bad words of several tokens read the request's newest output tokens, some of them still on
the device: they stay on the eager path (post_layer.dense_ok).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm.sampling_params import SamplingParams


def stop_bans(params: SamplingParams, vocab_size: int) -> list[int]:
    """The stop tokens min_tokens bans until that many tokens are out (those in the
    vocabulary: the others can never be sampled); [] when min_tokens bans nothing."""
    if params.min_tokens <= 0:
        return []
    return sorted(t for t in params.all_stop_token_ids if 0 <= t < vocab_size)


def one_token_bad_words(params: SamplingParams, vocab_size: int) -> list[int]:
    """The bad words of one token (in the vocabulary): banned at every position."""
    return [q[0] for q in params.bad_words_token_ids or () if len(q) == 1
            and 0 <= q[0] < vocab_size]


def _bits(ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(word index, bit within the word as uint32) of each token id."""
    a = np.asarray(ids, dtype=np.int64)
    return a >> 5, np.left_shift(np.uint32(1), (a & 31).astype(np.uint32))


def allowed_rows(params: SamplingParams, vocab_size: int, words: int) -> np.ndarray:
    """[2, words] int32 packed rows of the tokens the request may sample (bit j of word w
    allows token 32 w + j, as in a grammar bitmask): row 0 at any position, row 1 while
    min_tokens bans its stop tokens."""
    rows = np.full((2, words), 0xFFFFFFFF, dtype=np.uint32)
    if params.allowed_token_ids:
        word, bit = _bits([t for t in params.allowed_token_ids if 0 <= t < vocab_size])
        rows[:] = 0
        np.bitwise_or.at(rows[0], word, bit)
        rows[1] = rows[0]
    bad = one_token_bad_words(params, vocab_size)
    for row, ids in ((rows[0], bad), (rows[1], bad + stop_bans(params, vocab_size))):
        if ids:
            word, bit = _bits(ids)
            np.bitwise_and.at(row, word, ~bit)
    return rows.view(np.int32)


def bias_row(params: SamplingParams, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The request's logit_bias as `width` (token id int64, value float32) entries, padded
    with (0, 0.0), which adds nothing. Raises ValueError past `width` entries."""
    bias = params.logit_bias or {}
    if len(bias) > width:
        raise ValueError(f"logit_bias: {len(bias)} entries exceed {width}")
    ids = np.zeros(width, dtype=np.int64)
    values = np.zeros(width, dtype=np.float32)
    ids[: len(bias)] = list(bias)
    values[: len(bias)] = [float(v) for v in bias.values()]
    return ids, values
