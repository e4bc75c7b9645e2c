"""Top-k, top-p and min-p as one per-row threshold on the scaled logits.

Every filter keeps the tokens whose scaled logit z is >= a per-row value t (ties at t are
all kept, so the kept set is a function of the row's values alone, whatever order a sort or
top-k returns equal values in):
  top-k: t = the k-th largest z;
  top-p: over the top-k survivors renormalized, t = the z of the first token (in descending
         order) at which the cumulative probability reaches p;
  min-p: with z shifted so its maximum is 0, t = log(min_p)  (p_i >= min_p * p_max).
The combined threshold is the largest of the three.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class Candidates:
    """The K largest scaled logits of each row (descending) and the row's threshold."""

    values: torch.Tensor  # [n, K] float32, descending
    token_ids: torch.Tensor  # [n, K] int64
    threshold: torch.Tensor  # [n] float32; keep tokens with z >= threshold
    # [n] bool: every kept token of the row is among the K candidates.
    complete: torch.Tensor


def min_p_threshold(min_p: torch.Tensor) -> torch.Tensor:
    """Per-row threshold on z (max z = 0) for min-p; -inf where min_p is 0 (off)."""
    return torch.where(min_p > 0, torch.log(min_p), torch.full_like(min_p, NEG_INF))


def thresholds_from_sorted(
    values: torch.Tensor,
    vocab_size: int,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    full_lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k/top-p threshold from each row's K largest z (`values`, descending).

    `full_lse` [n] is logsumexp of the whole row, needed when a row has top-p but no top-k.
    Returns (threshold [n], complete [n]): `complete` is False where the K values cannot
    decide the row exactly (its kept set may reach past them); such rows need a larger K."""
    n, k_cand = values.shape
    neg = torch.full((n,), NEG_INF, dtype=values.dtype, device=values.device)
    threshold = neg
    ok = torch.ones(n, dtype=torch.bool, device=values.device)
    has_k = torch.zeros(n, dtype=torch.bool, device=values.device)
    if top_k is not None:
        k = top_k.to(torch.int64)
        has_k = (k > 0) & (k < vocab_size)
        ok = ~(has_k & (k > k_cand))
        kth = values.gather(1, (k.clamp(1, k_cand) - 1)[:, None]).squeeze(1)
        threshold = torch.where(has_k & ok, kth, neg)
    if top_p is not None:
        has_p = top_p < 1.0
        in_k = values >= threshold[:, None]
        # Renormalize over the top-k survivors (all inside `values` when ok), or over the
        # whole row when top-k is off.
        lse_k = torch.logsumexp(values.masked_fill(~in_k, NEG_INF), dim=1)
        lse = lse_k if full_lse is None else torch.where(has_k, lse_k, full_lse)
        probs = torch.exp(values - lse[:, None]).masked_fill(~in_k, 0.0)
        cum = probs.cumsum(dim=1)
        # The first index whose cumulative mass reaches p; == K when the K values fall short.
        cross = (cum < top_p[:, None]).sum(dim=1)
        tp = values.gather(1, cross.clamp(max=k_cand - 1)[:, None]).squeeze(1)
        threshold = torch.where(has_p, torch.maximum(threshold, tp), threshold)
    last = values[:, -1]
    # Tokens outside the candidates have z <= last, so the kept set is inside them when the
    # threshold is strictly above `last`; a -inf `last` means the rest of the row is masked.
    inside = (threshold > last) | (last == NEG_INF) | (k_cand >= vocab_size)
    return threshold, ok & inside


def candidates(
    z: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    full_lse: torch.Tensor | None,
    num_candidates: int,
) -> Candidates:
    """Top-k/top-p threshold per row of z [n, V] from its `num_candidates` largest values.

    Exactness: the K largest values of a row, sorted, are exactly the first K entries of a
    full descending sort (equal values may come in another order, which changes neither the
    cumulative sums at the end of a run of equal values nor the threshold value). So when
    the top-k cut and the top-p crossing both fall strictly inside the K values, the
    threshold equals the full-sort one; otherwise `complete` is False and the caller sorts
    that row fully (thresholds_from_sorted with K = V is always complete)."""
    vocab = z.shape[1]
    k = min(vocab, num_candidates)
    values, ids = torch.topk(z, k, dim=1)
    threshold, complete = thresholds_from_sorted(values, vocab, top_k, top_p, full_lse)
    return Candidates(values, ids, threshold, complete)


def sorted_candidates(
    z: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    full_lse: torch.Tensor | None,
) -> Candidates:
    """Like `candidates` with a full sort of each row: exact, always complete, slow on CPU
    (about 20 ms per row of 151,936), so only for rows `candidates` could not decide."""
    values, ids = torch.sort(z, dim=1, descending=True)
    threshold, complete = thresholds_from_sorted(values, z.shape[1], top_k, top_p, full_lse)
    return Candidates(values, ids, threshold, complete)
