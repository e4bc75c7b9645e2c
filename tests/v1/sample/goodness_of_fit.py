"""Pearson's chi-square goodness-of-fit test for the sampler's distribution tests.

No scipy: the critical value comes from the Wilson-Hilferty approximation. At the 1e-4
level it is above the exact quantile by under 3.5% for 3 or more degrees of freedom and by
under 0.6% from 20 on (checked against a high-precision incomplete gamma function), e.g.
28.38 vs 27.86 for 6 degrees of freedom and 52.67 vs 52.39 for 20.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

# A fixed, small significance level: with fixed seeds the tests are deterministic, and a
# correct sampler passes each one with probability 1 - ALPHA over the choice of seeds.
ALPHA = 1e-4
# Pearson's statistic is only close to chi-square when every expected count is about 5 or more.
MIN_EXPECTED = 5.0


@dataclass
class ChiSquare:
    """Result of a goodness-of-fit test."""

    statistic: float
    dof: int
    critical: float  # the upper ALPHA quantile of chi-square(dof)
    outside_support: float  # samples that fell where the reference probability is 0

    @property
    def passed(self) -> bool:
        """True when nothing fell outside the support and the statistic is below critical."""
        return self.outside_support == 0 and self.statistic < self.critical

    def __str__(self) -> str:
        return (
            f"chi2={self.statistic:.2f} dof={self.dof} critical(p={ALPHA:g})="
            f"{self.critical:.2f} outside_support={self.outside_support:g}"
        )


def chi_square_critical(dof: int, alpha: float = ALPHA) -> float:
    """Upper `alpha` quantile of chi-square(dof) by the Wilson-Hilferty approximation."""
    z = NormalDist().inv_cdf(1.0 - alpha)
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def chi_square_test(counts: torch.Tensor, probs: torch.Tensor) -> ChiSquare:
    """Tests observed `counts` [k] against reference `probs` [k] (summing to 1).

    Bins whose expected count is below MIN_EXPECTED are pooled into one bin (folded into
    the smallest other bin if the pool itself is still too small): rare tokens are tested
    together."""
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    n = float(counts.sum())
    support = probs > 0
    outside = float(counts[~support].sum())
    expected = probs[support] * n
    observed = counts[support]
    small = expected < MIN_EXPECTED
    exp_bins = [expected[~small]]
    obs_bins = [observed[~small]]
    if bool(small.any()):
        exp_bins.append(expected[small].sum().reshape(1))
        obs_bins.append(observed[small].sum().reshape(1))
    e = torch.cat(exp_bins)
    o = torch.cat(obs_bins)
    if e.numel() > 1 and float(e[-1]) < MIN_EXPECTED and bool(small.any()):
        # The pool is still too small: fold it into the smallest regular bin.
        j = int(e[:-1].argmin())
        e[j] += e[-1]
        o[j] += o[-1]
        e, o = e[:-1], o[:-1]
    if e.numel() < 2:
        raise ValueError("chi_square_test: needs at least two bins with enough expected count")
    statistic = float(((o - e) ** 2 / e).sum())
    dof = e.numel() - 1
    return ChiSquare(statistic, dof, chi_square_critical(dof), outside)
