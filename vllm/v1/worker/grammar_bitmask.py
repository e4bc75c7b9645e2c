"""The runner's grammar bitmask: put the rows in batch order and apply them to logits."""

from __future__ import annotations

import numpy as np
import torch

from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.sample.metadata import GrammarMask


def reorder_bitmask(
    grammar_output: GrammarOutput, req_id_to_row: dict[str, int]
) -> tuple[np.ndarray, list[int]]:
    """Returns (bitmask, rows): `bitmask[r]` holds the mask of the request in batch row r, for
    each r in `rows`; other rows of `bitmask` are unspecified. A request id repeated on
    consecutive bitmask rows (drafted positions) maps to consecutive rows from its row.

    Requests of the GrammarOutput that are not in the batch are skipped.
    Raises ValueError when the bitmask has a different number of rows than request ids.
    """
    ids = grammar_output.structured_output_request_ids
    source = grammar_output.grammar_bitmask
    if source.ndim != 2 or source.shape[0] != len(ids):
        raise ValueError(
            f"grammar_bitmask: expected {len(ids)} rows (one per request id), got shape "
            f"{source.shape}"
        )
    src: list[int] = []
    rows: list[int] = []
    seen: dict[str, int] = {}
    for i, req_id in enumerate(ids):
        row = req_id_to_row.get(req_id)
        if row is not None:
            offset = seen.get(req_id, 0)
            seen[req_id] = offset + 1
            src.append(i)
            rows.append(row + offset)
    if not rows:
        return np.empty((0, source.shape[1]), dtype=np.int32), rows
    # Only rows in `rows` are read by the kernel, so the others may stay uninitialized.
    bitmask = np.empty((max(rows) + 1, source.shape[1]), dtype=np.int32)
    bitmask[rows] = source[src]
    return bitmask, rows


def grammar_mask(
    grammar_output: GrammarOutput, req_id_to_row: dict[str, int], num_rows: int,
    vocab_size: int,
) -> GrammarMask | None:
    """The bitmasks of [num_rows, vocab_size] logits for the sampler to apply (None: no row
    is constrained). Same row rules and errors as apply_grammar_bitmask; changes nothing."""
    if not grammar_output.structured_output_request_ids:
        return None
    words = grammar_output.grammar_bitmask.shape[-1]
    if words != (vocab_size + 31) // 32:
        raise ValueError(
            f"grammar_bitmask: {words} words per row cannot mask a vocabulary of {vocab_size}"
        )
    bitmask, rows = reorder_bitmask(grammar_output, req_id_to_row)
    if not rows:
        return None
    if max(rows) >= num_rows:
        raise ValueError(f"req_id_to_row: row {max(rows)} is outside logits ({num_rows} rows)")
    mask_rows = np.full(num_rows, -1, dtype=np.int64)
    mask_rows[rows] = rows
    return GrammarMask(bitmask, mask_rows)


def apply_grammar_bitmask(
    logits: torch.Tensor, grammar_output: GrammarOutput, req_id_to_row: dict[str, int]
) -> None:
    """Sets the disallowed tokens' logits to -inf in the constrained rows, in place.

    `req_id_to_row` maps request ids to rows of `logits` ([num_rows, vocab_size], float32,
    bfloat16 or float16, on any device); rows of other requests are left untouched.
    Raises ValueError when the bitmask width does not match the vocabulary.
    """
    if not grammar_output.structured_output_request_ids:
        return
    vocab_size = logits.shape[-1]
    words = grammar_output.grammar_bitmask.shape[-1]
    if words != (vocab_size + 31) // 32:
        raise ValueError(
            f"grammar_bitmask: {words} words per row cannot mask a vocabulary of {vocab_size}"
        )
    bitmask, rows = reorder_bitmask(grammar_output, req_id_to_row)
    if not rows:
        return
    if max(rows) >= logits.shape[0]:
        raise ValueError(
            f"req_id_to_row: row {max(rows)} is outside logits ({logits.shape[0]} rows)"
        )
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        # The native word-at-a-time loop is ~10x faster than xgrammar's CPU kernel.
        from vllm import _custom_ops as ops

        index = np.asarray(rows, dtype=np.int64)
        ops.apply_token_bitmask(logits.numpy(), bitmask, index, index)
        return
    import xgrammar as xgr  # deferred: runners that never see a grammar never import it

    mask = torch.from_numpy(bitmask)
    if logits.device.type != "cpu":
        mask = mask.pin_memory().to(logits.device, non_blocking=True)
    # Every row constrained: the kernel's whole-batch path is faster than per-index rows.
    indices = None if len(set(rows)) == logits.shape[0] else rows
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab_size, indices=indices)
