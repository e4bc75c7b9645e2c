"""Tests for vllm/v1/sample/ops/race_sampling.py: the noise hash and the two race shapes."""

from __future__ import annotations

import math

import torch

import pytest
from v1.sample.goodness_of_fit import chi_square_test

from vllm.v1.sample.ops import race_sampling
from vllm.v1.sample.ops.race_sampling import (
    gumbel,
    gumbel_from_uniform,
    noise_hash,
    race_blocks,
    race_candidates,
    seeded_key,
    uniform_from_hash,
)

M32 = 0xFFFFFFFF
INF = float("inf")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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


# --------------------------------------------------------------- extreme noise values


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_is_strictly_inside_0_1_and_noise_finite_for_every_hash(device: str) -> None:
    # uniform_from_hash reads only the top bits of the 32-bit hash (the low ones are shifted
    # away), so the 2**24 hashes whose low byte is 0, checked against the same hashes with
    # the low byte all ones, cover all 2**32 hash values.
    h = torch.arange(1 << 24, dtype=torch.int64, device=device) << 8
    u = uniform_from_hash(h)
    assert u.dtype == torch.float32
    assert torch.equal(u, uniform_from_hash(h | 0xFF))
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    # Exactly uniform: the distinct values are equally spaced, each hit equally often, and
    # symmetric about 1/2 (so no value is a rounded duplicate of its neighbour).
    values, hits = torch.unique_consecutive(u, return_counts=True)
    assert bool((values[1:] > values[:-1]).all())
    assert int(hits.min()) == int(hits.max())
    assert torch.equal(values + values.flip(0), torch.ones_like(values))
    g = gumbel_from_uniform(u)
    assert bool(torch.isfinite(g).all())
    # The docstring's bound on the noise, which the race's masking relies on.
    assert float(g.abs().max()) < 17.0


def _mix_int(x: int) -> int:
    return int(race_sampling._mix(torch.tensor([x], dtype=torch.int64)))


def _unxorshift(y: int, s: int) -> int:
    x = y
    for _ in range(32 // s + 1):
        x = y ^ (x >> s)
    return x


def _unmix(h: int) -> int:
    """Inverse of the 32-bit mix (xorshifts and odd multipliers are bijections)."""
    x = _unxorshift(h, 16)
    x = (x * pow(race_sampling._C2, -1, 1 << 32)) & M32
    x = _unxorshift(x, 15)
    x = (x * pow(race_sampling._C1, -1, 1 << 32)) & M32
    return _unxorshift(x, 16)


def key_hitting(counter: int, target: int) -> torch.Tensor:
    """A [1, 2] key whose noise hash at `counter` is `target`."""
    k2 = _unmix(target) ^ _mix_int(counter & M32)
    key = torch.tensor([[0, k2]], dtype=torch.int64)
    assert int(noise_hash(key, torch.tensor([counter]))) == target
    return key


@pytest.mark.parametrize("target", [0, M32])
@pytest.mark.parametrize("counter", [0, 93696, 151936 + 183])
def test_gumbel_is_finite_at_the_extreme_hashes(counter: int, target: int) -> None:
    g = gumbel(key_hitting(counter, target), torch.tensor([counter]))
    assert bool(torch.isfinite(g).all()), float(g)


def test_an_unlikely_token_with_the_largest_noise_does_not_always_win() -> None:
    # z differs by more than the whole noise range, so token 0 must win whatever the noise.
    z = torch.tensor([[0.0, -40.0]])
    key = key_hitting(1, M32)
    assert int(race_blocks(z, None, key, block=2)) == 0
    assert int(race_candidates(z, torch.tensor([[0, 1]]), torch.tensor([-INF]), key)) == 0


def test_race_blocks_never_picks_an_all_masked_block_with_the_largest_noise() -> None:
    # The failure seen in serving: an all-masked block drew +inf, scored -inf + inf = nan and
    # won, and its first (masked) token was sampled.
    vocab, block, masked = 2048 + 100, 512, 2
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, vocab, generator=g)
    z[0, masked * block : (masked + 1) * block] = -INF
    z[0, 7::3] = -INF
    z -= z.max()
    key = key_hitting(vocab + masked, M32)
    tok = int(race_blocks(z, None, key, block))
    assert torch.isfinite(z[0, tok]), tok
    # The same with the block masked by min-p instead of -inf.
    z2 = torch.randn(1, vocab, generator=g)
    z2[0, masked * block : (masked + 1) * block] = -50.0
    z2 -= z2.max()
    tok = int(race_blocks(z2, torch.tensor([-10.0]), key, block))
    assert float(z2[0, tok]) >= -10.0, tok


def test_race_blocks_never_picks_a_masked_token_with_the_largest_noise() -> None:
    z = torch.tensor([[0.0, -1.0, -INF, -0.5, -2.0, -INF, -0.3, -1.2]])
    for masked in (2, 5):
        tok = int(race_blocks(z, None, key_hitting(masked, M32), block=8))
        assert torch.isfinite(z[0, tok]), tok


def test_race_candidates_never_picks_a_masked_candidate_with_the_largest_noise() -> None:
    # Top-k can keep -inf (grammar-masked) values as candidates when fewer than k are finite.
    values = torch.tensor([[0.0, -INF, -1.0, -INF]])
    ids = torch.tensor([[5, 9, 7, 3]])
    for masked in (9, 3):
        key = key_hitting(masked, M32)
        for thr in (-INF, -2.0):
            tok = int(race_candidates(values, ids, torch.tensor([thr]), key))
            assert tok in (5, 7), (masked, thr, tok)


# ------------------------------------------------------------------------ distribution


def _keys(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1 << 32, (n, 2), generator=torch.Generator().manual_seed(seed))


def _race_blocks_counts(z: torch.Tensor, thr: float | None, n: int, block: int) -> torch.Tensor:
    zz = (z - z.max()).repeat(n, 1)
    t = None if thr is None else torch.full((n,), thr)
    out = race_blocks(zz, t, _keys(n, 17), block)
    return torch.bincount(out, minlength=z.numel())


def _reference(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.softmax(z.double().masked_fill(~keep, -INF), dim=0)


@pytest.mark.parametrize("block", [1, 5, 16, 64])
@pytest.mark.parametrize("thr", [None, -2.5])
def test_race_blocks_matches_softmax_chi_square(block: int, thr: float | None) -> None:
    g = torch.Generator().manual_seed(23)
    vocab = 37  # 7 blocks of 5 and a partial one of 2; a single partial block for 64
    z = torch.randn(vocab, generator=g) * 1.2
    z[[3, 10, 11, 12, 13, 14]] = -INF  # a whole block of 5 masked, like a grammar would
    z -= z.max()
    n = 40_000
    counts = _race_blocks_counts(z, thr, n, block)
    keep = torch.isfinite(z) if thr is None else z >= thr
    result = chi_square_test(counts, _reference(z, keep))
    assert result.passed, str(result)
    # The test can fail: the same draws are far off a slightly tempered distribution.
    assert not chi_square_test(counts, _reference(z * 1.1, keep)).passed


@pytest.mark.parametrize("thr", [-INF, -1.5])
def test_race_candidates_matches_softmax_chi_square(thr: float) -> None:
    g = torch.Generator().manual_seed(29)
    n, vocab, m = 40_000, 50, 12
    z = torch.randn(vocab, generator=g)
    ids = torch.randperm(vocab, generator=g)[:m]
    z_c = z[ids]
    z_c[4] = -INF
    z_c -= z_c.max()
    # Every row lists the same candidates in its own order: the race must not care.
    order = torch.argsort(torch.rand(n, m, generator=g), dim=1)
    out = race_candidates(z_c[order], ids[order], torch.full((n,), thr), _keys(n, 31))
    counts = torch.bincount(out, minlength=vocab)
    ref = torch.zeros(vocab, dtype=torch.float64)
    ref[ids] = _reference(z_c, z_c >= thr)
    result = chi_square_test(counts, ref)
    assert result.passed, str(result)
    wrong = torch.zeros(vocab, dtype=torch.float64)
    wrong[ids] = _reference(z_c * 0.9, z_c >= thr)
    assert not chi_square_test(counts, wrong).passed
