"""Verification of drafted tokens: which drafts the target model keeps, on the device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Output id of a position past the kept tokens.
NO_TOKEN = -1


def verify_drafts(
    sampled: torch.Tensor, num_rows: Sequence[int], drafts: Sequence[Sequence[int]],
    guesses: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keeps, per request, the drafts that match the target's own samples, plus one token.

    `sampled` ([sum(num_rows)] int64) holds the target's token for every verified position:
    request i owns `num_rows[i]` consecutive rows, row j sampled after its first j drafts
    (`drafts[i]`, num_rows[i] - 1 tokens). Returns (tokens [n, max(num_rows)] with NO_TOKEN
    past the kept ones, last [n]: each request's newest kept token), both on the device.

    Draft j + 1 is kept while every earlier one was and the target's sample at row j equals
    it; the first sample that differs (or the one after the last draft) ends the output.
    Every kept token is therefore the target's own sample given the tokens before it: greedy
    rows reproduce the non-speculative argmax, and a seeded row draws the same value as
    without drafts (the seed mixes in the output position). For a deterministic proposer
    (the draft is a point mass q) this is exactly the standard accept/resample rule: draft d
    is kept with probability p(d) = min(1, p(d)/q(d)), and a rejected position emits a
    sample of p conditioned on differing from d, which is the normalised max(0, p - q).

    `guesses` ([n, at least max(num_rows) - 1] on the device, NO_TOKEN - 1 past each
    request's drafts) replaces `drafts` as the values compared where the drafts' values
    live on the device only (EAGLE-3 drafts the runner put in); `drafts` still gives counts.
    """
    sampled = sampled.to(torch.int64)
    width = max(num_rows)
    if width == 1:
        # Nothing drafted (every step without speculative decoding): the samples are the output.
        return sampled[:, None], sampled
    rows = np.asarray(num_rows, dtype=np.int64)
    cols = np.arange(width, dtype=np.int64)
    total = int(sampled.shape[0])
    # Row j of request i is flat row starts[i] + j; `total` picks the padding below.
    starts = np.cumsum(rows) - rows
    index = np.where(cols[None, :] < rows[:, None], starts[:, None] + cols[None, :], total)
    device = sampled.device
    if guesses is None:
        host = np.full((len(rows), width - 1), NO_TOKEN - 1, dtype=np.int64)  # never matches
        for i, tokens in enumerate(drafts):
            if tokens:
                host[i, : len(tokens)] = tokens
        guesses = torch.from_numpy(host).to(device, non_blocking=True)
    padded = torch.cat([sampled, sampled.new_full((1,), NO_TOKEN)])
    table = padded[torch.from_numpy(index).to(device, non_blocking=True)]
    match = table[:, :-1] == guesses[:, : width - 1]
    accepted = torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1)
    keep = torch.arange(width, device=device)[None, :] <= accepted[:, None]
    tokens = torch.where(keep, table, torch.full_like(table, NO_TOKEN))
    last = table.gather(1, accepted[:, None]).squeeze(1)
    return tokens, last


def with_fast_forward(
    sampled: torch.Tensor, drafts: Sequence[Sequence[int]], skipped: Sequence[int]
) -> torch.Tensor:
    """The samples of every verified position, for verify_drafts: request i's first
    `skipped[i]` drafts are exact fast-forward tokens, sampled nowhere (each was the only
    token its position allowed, so it is what a sample there gives); `sampled` holds the
    rows of the other positions, request by request. Returns `sampled` itself when nothing
    was skipped, else a new tensor on its device."""
    if not any(skipped):
        return sampled
    counts = np.asarray([1 + len(d) for d in drafts], dtype=np.int64)
    skip = np.asarray(skipped, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    # Full row of each sampled row: its request's start, past the skipped ones.
    kept = counts - skip
    offsets = np.arange(int(kept.sum()), dtype=np.int64) - np.repeat(np.cumsum(kept) - kept,
                                                                      kept)
    to_full = np.repeat(starts + skip, kept) + offsets
    forced = np.full(int(counts.sum()), NO_TOKEN, dtype=np.int64)
    for start, k, tokens in zip(starts.tolist(), skipped, drafts):
        forced[start : start + k] = tokens[:k]
    device = sampled.device
    full = torch.from_numpy(forced).to(device, non_blocking=True)
    full[torch.from_numpy(to_full).to(device, non_blocking=True)] = sampled.to(torch.int64)
    return full
