"""Tests for vllm/v1/sample/ops/race.py: the noise hash and the two race shapes."""

from __future__ import annotations

import math

import torch

from vllm.v1.sample.ops.race import gumbel, race_blocks, race_candidates, seeded_key


def test_gumbel_noise_has_gumbel_moments_and_no_cross_row_correlation() -> None:
    keys = torch.tensor([[1, 2], [1, 3], [2, 2], [123456789, 987654321]], dtype=torch.int64)
    g = gumbel(keys, torch.arange(200_000))
    assert g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    euler = 0.5772156649
    for row in g.double():
        assert abs(float(row.mean()) - euler) < 0.01
        assert abs(float(row.var()) - math.pi**2 / 6) < 0.03
    corr = torch.corrcoef(g.double())
    assert float((corr - torch.eye(4, dtype=torch.float64)).abs().max()) < 0.01
    lag1 = torch.corrcoef(torch.stack([g[0, :-1], g[0, 1:]]).double())[0, 1]
    assert abs(float(lag1)) < 0.01
    # Uniform underneath: P(g <= 0) = exp(-1).
    assert abs(float((g <= 0).double().mean()) - math.exp(-1)) < 0.003


def test_gumbel_is_a_pure_function_of_key_and_counter() -> None:
    keys = torch.tensor([[5, 6], [7, 8]], dtype=torch.int64)
    a = gumbel(keys, torch.tensor([[10, 20, 30], [40, 50, 60]]))
    b = gumbel(keys[1:], torch.tensor([[60, 40]]))
    assert a[1, 2] == b[0, 0] and a[1, 0] == b[0, 1]


def test_seeded_key_mixes_seed_and_position() -> None:
    keys = {seeded_key(s, p) for s in range(30) for p in range(30)}
    assert len(keys) == 900
    assert all(0 <= a < 2**32 and 0 <= b < 2**32 for a, b in keys)
    assert seeded_key(-1, 0) == seeded_key(-1, 0)


def test_race_candidates_ignores_candidate_order_and_count() -> None:
    keys = torch.tensor([[11, 22]], dtype=torch.int64)
    values = torch.tensor([[0.0, -0.1, -0.2, -0.3, -5.0]])
    ids = torch.tensor([[4, 9, 2, 7, 1]])
    thr = torch.tensor([-0.25])
    a = race_candidates(values, ids, thr, keys)
    perm = torch.tensor([3, 0, 2, 1])
    b = race_candidates(values[:, perm], ids[:, perm], thr, keys)
    c = race_candidates(values, ids, thr, keys)
    assert int(a) == int(b) == int(c)
    assert int(a) in (4, 9, 2)


def test_race_blocks_distribution_and_threshold() -> None:
    n, vocab = 8000, 11
    z = torch.tensor([0.0, -1.0, -0.5, -3.0, -0.2, -2.0, -0.7, -1.5, -float("inf"), -0.1, -0.4])
    keys = torch.randint(0, 2**32, (n, 2), generator=torch.Generator().manual_seed(3))
    thr = torch.full((n,), -1.6)
    out = race_blocks(z.repeat(n, 1), thr, keys, block=4)
    counts = torch.bincount(out, minlength=vocab).double()
    probs = torch.softmax(z.double().masked_fill(z < -1.6, -float("inf")), dim=0)
    assert counts[probs == 0].sum() == 0
    expected = probs * n
    mask = expected > 0
    chi2 = float(((counts - expected)[mask] ** 2 / expected[mask]).sum())
    assert chi2 < 30  # 7 degrees of freedom
