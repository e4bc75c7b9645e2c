"""Tests for vllm/v1/sample/ops/topk_topp.py against a float64 full-sort reference."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.sample.ops.topk_topp import candidates, min_p_threshold, sorted_candidates

INF = float("inf")


def reference_keep(z: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Boolean keep-mask of one row by the textbook definition (sort, cumulate)."""
    zd = z.double()
    vocab = zd.numel()
    order = torch.argsort(zd, descending=True, stable=True)
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[order[: k if 0 < k < vocab else vocab]] = True
    keep &= torch.isfinite(zd) | (k == 0)
    if p < 1.0:
        probs = torch.softmax(zd.masked_fill(~keep, -INF), dim=0)
        cum = probs[order].cumsum(0)
        last = int((cum < p).sum().clamp(max=vocab - 1))
        nucleus = torch.zeros(vocab, dtype=torch.bool)
        nucleus[order[: last + 1]] = True
        keep &= nucleus
    return keep


@pytest.mark.parametrize("num", [4, 64, 10_000])
def test_thresholds_keep_the_reference_set(num: int) -> None:
    g = torch.Generator().manual_seed(0)
    n, vocab = 40, 300
    scale = torch.rand(n, 1, generator=g) * 6
    z = torch.randn(n, vocab, generator=g) * scale
    z -= z.amax(1, keepdim=True)
    top_k = torch.randint(0, 60, (n,), generator=g, dtype=torch.int32)
    top_k[::5] = 0
    top_p = torch.rand(n, generator=g) * 0.9 + 0.05
    top_p[::3] = 1.0
    lse = torch.logsumexp(z, dim=1)
    cand = candidates(z, top_k, top_p, lse, num)
    full = sorted_candidates(z, top_k, top_p, lse)
    assert bool(full.complete.all())
    for i in range(n):
        ref = reference_keep(z[i], int(top_k[i]), float(top_p[i]))
        assert torch.equal(z[i] >= full.threshold[i], ref), i
        if cand.complete[i]:
            assert float(cand.threshold[i]) == float(full.threshold[i]), i
            kept = set(torch.nonzero(z[i] >= cand.threshold[i]).squeeze(1).tolist())
            assert kept <= set(cand.token_ids[i].tolist())
    if num >= vocab:
        assert bool(cand.complete.all())
    if num == 4:
        assert not bool(cand.complete.all())  # the fallback is needed somewhere


def test_incomplete_when_top_k_exceeds_candidates_or_ties_run_past_them() -> None:
    z = torch.tensor([[0.0, -1.0, -2.0, -3.0, -4.0, -5.0], [0.0, -1.0, -1.0, -1.0, -1.0, -2.0]])
    top_k = torch.tensor([5, 2], dtype=torch.int32)
    cand = candidates(z, top_k, None, None, 3)
    assert cand.complete.tolist() == [False, False]
    full = sorted_candidates(z, top_k, None, None)
    assert full.threshold.tolist() == [-4.0, -1.0]  # ties at the k-th value are all kept


def test_masked_rows_stay_complete() -> None:
    z = torch.full((1, 100), -INF)
    z[0, [3, 50]] = torch.tensor([0.0, -0.5])
    cand = candidates(z, torch.tensor([0]), torch.tensor([0.99999]), torch.logsumexp(z, 1), 8)
    assert bool(cand.complete[0])
    assert set(torch.nonzero(z[0] >= cand.threshold[0]).squeeze(1).tolist()) == {3, 50}


def test_min_p_threshold() -> None:
    t = min_p_threshold(torch.tensor([0.0, 0.5, 1.0]))
    assert t[0] == -INF and abs(float(t[1]) - float(torch.log(torch.tensor(0.5)))) < 1e-7
    assert float(t[2]) == 0.0
