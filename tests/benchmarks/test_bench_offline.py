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


def test_structured_schema_is_sized_from_the_output_length() -> None:
    # The tilted demo models close a JSON string as soon as the grammar lets them: the
    # string's minimum length is what keeps structured cells as long as plain ones.
    short, long = (bench_offline.structured_schema(n) for n in (16, 128))
    title = long["properties"]["title"]
    assert title["minLength"] == bench_offline.CHARS_PER_TOKEN * 128
    assert short["properties"]["title"]["minLength"] < title["minLength"]
    assert long["required"] == ["title", "score"]


def test_shortfall_flags_cells_with_fewer_tokens() -> None:
    assert bench_offline.shortfall(64 * 128, 64, 128) is None
    warning = bench_offline.shortfall(832, 64, 128)
    assert warning is not None and "832 of 8192" in warning
