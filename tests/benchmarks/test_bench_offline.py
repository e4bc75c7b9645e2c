"""Tests for benchmarks/bench_offline.py's summaries of interleaved rounds."""

from __future__ import annotations

import pytest

from tests.benchmarks.scripts import load_script

bench_offline = load_script("bench_offline")


def test_spread_is_median_then_range() -> None:
    assert bench_offline.spread([2.0, 1.0, 2.5]) == "2.00 (1.00-2.50)"
    assert bench_offline.spread([300.04, 290.0], 1) == "295.0 (290.0-300.0)"


def test_ratios_pair_cells_of_the_same_round() -> None:
    # Round 2 ran on a machine twice as slow: within-round ratios do not see it.
    engine, bare = [90.0, 45.0, 90.0], [100.0, 50.0, 100.0]
    assert bench_offline.paired_ratios(engine, bare) == [0.9, 0.9, 0.9]
    with pytest.raises(ValueError):
        bench_offline.paired_ratios(engine, bare[:2])  # a missing round is an error
