"""Per-request edits of the logits that name tokens: allowed_token_ids, logit_bias and
bad words. Each touches only the rows that asked for it and never syncs with the device."""

from __future__ import annotations

import torch

# Marks a position of a bad word's prefix that matches any token (left padding).
_ANY = -2


def keep_only(logits: torch.Tensor, allowed: dict[int, list[int]]) -> None:
    """Sets every logit of row r outside allowed[r] to -inf. Side effect: edits `logits`."""
    if not allowed:
        return
    dev = logits.device
    rows = [row for row, ids in allowed.items() for _ in ids]
    ids = [t for tokens in allowed.values() for t in tokens]
    r = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    t = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
    # O(allowed ids) host work: keep the allowed values, clear the rows, put them back.
    kept = logits[r, t]
    logits[torch.tensor(list(allowed), dtype=torch.int64).to(dev, non_blocking=True)] = float(
        "-inf")
    logits[r, t] = kept


def add_bias(logits: torch.Tensor, bias: dict[int, tuple[list[int], list[float]]]) -> None:
    """Adds bias[r] = (token ids, values) to row r. Side effect: edits `logits`."""
    if not bias:
        return
    rows = [row for row, (ids, _) in bias.items() for _ in ids]
    ids = [t for tokens, _ in bias.values() for t in tokens]
    values = [v for _, vs in bias.values() for v in vs]
    dev = logits.device
    index = (
        torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True),
        torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
    )
    logits.index_put_(
        index, torch.tensor(values, dtype=logits.dtype).to(dev, non_blocking=True), accumulate=True
    )


def ban_completions(
    logits: torch.Tensor, words: dict[int, list[list[int]]], recent: torch.Tensor
) -> None:
    """For each row r and each sequence q in words[r] of two or more tokens: sets the logit
    of q's last token to -inf where row r's newest output tokens (`recent`[r], right-aligned,
    [n, W] with W >= len(q) - 1) equal q's other tokens. Side effect: edits `logits`."""
    rows: list[int] = []
    lasts: list[int] = []
    prefixes: list[list[int]] = []
    width = recent.shape[1]
    for row, seqs in words.items():
        for q in seqs:
            if len(q) > 1:
                rows.append(row)
                lasts.append(q[-1])
                prefixes.append([_ANY] * (width - len(q) + 1) + q[:-1])
    if not rows:
        return
    dev = logits.device
    r = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    p = torch.tensor(prefixes, dtype=torch.int64).to(dev, non_blocking=True)
    match = ((recent[r] == p) | (p == _ANY)).all(dim=1)
    # Adding -inf or 0 with accumulate: a token two words ban (or not) gets a defined result.
    penalty = torch.where(match, float("-inf"), 0.0).to(logits.dtype)
    t = torch.tensor(lasts, dtype=torch.int64).to(dev, non_blocking=True)
    logits.index_put_((r, t), penalty, accumulate=True)
