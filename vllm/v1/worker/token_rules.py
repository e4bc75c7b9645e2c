"""A decode step's token edits in the fixed form the post-layer function reads (post_layer.py).

Every edit that forbids tokens (allowed_token_ids, one-token bad words, the min_tokens ban of
the stop tokens) becomes bits cleared in the row's bitmask, next to its grammar's. A
forbidden logit is -inf whichever edit set it, and a bias added to -inf leaves -inf, so the
logits come out as the Sampler's, which applies them in its own order (grammar, allowed
ids, bad words, bias, min_tokens ban). logit_bias becomes (row, token id, value) entries
that one accumulating index_put adds.

Penalties and bad words of several tokens read the request's output tokens, some of them
still on the device: they stay on the eager path (post_layer.dense_ok).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm.sampling_params import SamplingParams


def banned_ids(params: SamplingParams, position: int, vocab_size: int) -> list[int]:
    """The token ids a request may not sample at output index `position`: its one-token bad
    words, and its stop tokens while fewer than min_tokens are out. Ids outside the
    vocabulary are left out (they can never be sampled)."""
    ids = [q[0] for q in params.bad_words_token_ids or () if len(q) == 1]
    if position < params.min_tokens:
        ids += params.all_stop_token_ids
    return [t for t in ids if 0 <= t < vocab_size]


def _bits(ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(word index, bit within the word as uint32) of each token id."""
    a = np.asarray(ids, dtype=np.int64)
    return a >> 5, np.left_shift(np.uint32(1), (a & 31).astype(np.uint32))


def masked_rows(
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    vocab_size: int,
    words: int,
    bitmask: np.ndarray | None,
    mask_rows: list[int],
) -> tuple[np.ndarray | None, list[int]]:
    """The step's bitmask with every row's token bans added: returns (bitmask, rows) where
    `bitmask[r]` ([*, words] int32) is row r's mask for each r in rows. `bitmask` and
    `mask_rows` hold the grammar's rows (as reorder_bitmask gives them; not modified); a
    row that only bans tokens starts from 'every token allowed'."""
    edits: dict[int, list[int]] = {}
    for row, (p, position) in enumerate(zip(params, positions)):
        banned = banned_ids(p, position, vocab_size)
        if banned or p.allowed_token_ids:
            edits[row] = banned
    if not edits:
        return bitmask, mask_rows
    rows = sorted(set(mask_rows) | set(edits))
    out = np.empty((rows[-1] + 1, words), dtype=np.int32)
    out[rows] = -1
    if mask_rows:
        out[mask_rows] = bitmask[mask_rows]
    # Bit 31 is the sign of an int32 word: edit the words as uint32.
    unsigned = out.view(np.uint32)
    for row, banned in edits.items():
        allowed = params[row].allowed_token_ids
        if allowed:
            keep = np.zeros(words, dtype=np.uint32)
            word, bit = _bits([t for t in allowed if 0 <= t < vocab_size])
            np.bitwise_or.at(keep, word, bit)
            unsigned[row] &= keep
        if banned:
            word, bit = _bits(banned)
            np.bitwise_and.at(unsigned[row], word, ~bit)
    return out, rows


def bias_entries(params: Sequence[SamplingParams]) -> dict[str, np.ndarray] | None:
    """The step's logit_bias as bias_rows, bias_ids (int64) and bias_values (float32) arrays
    of one entry per (row, token), the sections SamplingBuffers.stage takes; None when no
    request has a bias."""
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows += [row] * len(p.logit_bias)
            ids += list(p.logit_bias)
            values += (float(v) for v in p.logit_bias.values())
    if not ids:
        return None
    return {
        "bias_rows": np.asarray(rows, dtype=np.int64),
        "bias_ids": np.asarray(ids, dtype=np.int64),
        "bias_values": np.asarray(values, dtype=np.float32),
    }
