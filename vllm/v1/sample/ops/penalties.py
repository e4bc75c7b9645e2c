"""Logit edits before sampling: the min_tokens ban and repetition/frequency/presence penalties."""

from __future__ import annotations

import numpy as np
import torch


def ban_tokens(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    """Sets logits[rows[i], token_ids[i]] to -inf for every i. Side effect: edits `logits`."""
    if not rows:
        return
    dev = logits.device
    r = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    t = torch.tensor(token_ids, dtype=torch.int64).to(dev, non_blocking=True)
    logits.index_put_((r, t), torch.tensor(float("-inf"), device=dev))


def pad_token_array(lists: list[list[int]], pad: int) -> np.ndarray:
    """Packs ragged token lists into a [len(lists), max(max_len, 1)] int64 array padded with
    `pad`."""
    width = max((len(x) for x in lists), default=0)
    # Filled in numpy: no tensor operation per row (the host cost stays flat in the batch).
    out = np.full((len(lists), max(width, 1)), pad, dtype=np.int64)
    for i, x in enumerate(lists):
        if x:
            out[i, : len(x)] = x
    return out


def pad_token_lists(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """pad_token_array on `device`."""
    return torch.from_numpy(pad_token_array(lists, pad)).to(device, non_blocking=True)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor | None,
    output_ids: torch.Tensor,
    repetition: torch.Tensor | None,
    frequency: torch.Tensor | None,
    presence: torch.Tensor | None,
) -> torch.Tensor:
    """Returns `logits` [n, V] with OpenAI/HF penalties applied (a new tensor; input unchanged).

    `prompt_ids` [n, Lp] and `output_ids` [n, Lo] are int64 padded with V. Repetition
    divides positive / multiplies negative logits of tokens seen in prompt or output;
    frequency subtracts count * penalty and presence subtracts the penalty once, both over
    output tokens. A row with penalties 1 / 0 / 0 comes back bit-identical."""
    n, vocab = logits.shape
    # A spare last column absorbs the writes of the padding ids, so no id needs filtering
    # (which would need a device sync to size the result).
    work = logits.new_empty((n, vocab + 1))
    work[:, :vocab] = logits
    if repetition is not None:
        seen = output_ids if prompt_ids is None else torch.cat([prompt_ids, output_ids], dim=1)
        vals = work.gather(1, seen)
        r = repetition[:, None]
        # Duplicated ids all write the same value (computed from the original), so the
        # scatter is deterministic.
        work.scatter_(1, seen, torch.where(vals > 0, vals / r, vals * r))
    if frequency is not None or presence is not None:
        # Counts are small integers in float32: exact whatever the order of the adds.
        counts = torch.zeros_like(work)
        counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=work.dtype))
        cnt = counts.gather(1, output_ids)
        vals = work.gather(1, output_ids)
        if frequency is not None:
            vals = vals - frequency[:, None] * cnt
        if presence is not None:
            vals = vals - presence[:, None] * (cnt > 0).to(work.dtype)
        work.scatter_(1, output_ids, vals)
    return work[:, :vocab]
