"""Tests for benchmarks/bench_scaling.py: decode step times, the overhead growth exponent and
the chart (the benchmark itself takes minutes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.benchmarks.scripts import load_script

load_script("bench_offline")  # bench_scaling imports it by name
bench = load_script("bench_scaling")


def test_step_seconds_are_the_decode_time_per_step() -> None:
    assert bench.step_seconds(3.5, 0.5, 7) == pytest.approx(0.5)
    assert bench.step_seconds(0.4, 0.5, 7) == 0.0  # noise never gives a negative step
    with pytest.raises(ValueError, match="at least 2"):
        bench.step_seconds(1.0, 0.5, 1)


def test_growth_exponent() -> None:
    assert bench.growth_exponent([1, 4, 16], [2.0, 5.0, 32.0]) == pytest.approx(
        math.log(16) / math.log(16))
    assert bench.growth_exponent([16, 1], [4.0, 1.0]) == pytest.approx(0.5)
    assert bench.growth_exponent([4], [1.0]) is None
    assert bench.growth_exponent([1, 8], [-1.0, 2.0]) is None


def test_chart_has_an_engine_and_a_bare_line_per_context(tmp_path: Path) -> None:
    records = [
        {"context": c, "batch": b, "engine_tok_s": 10.0 * b, "bare_tok_s": 12.0 * b}
        for c in (128, 1024) for b in (1, 4)
    ]
    path = bench.chart(records, tmp_path / "s.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cells_skip_pairs_past_the_token_limit() -> None:
    assert bench.cells([8, 1], [1024, 128], None) == [(128, 1), (128, 8), (1024, 1), (1024, 8)]
    assert bench.cells([1, 8, 64], [128, 1024], 8192) == [(128, 1), (128, 8), (128, 64),
                                                          (1024, 1), (1024, 8)]


def test_chart_leaves_a_gap_for_a_cell_not_run(tmp_path: Path) -> None:
    records = [
        {"context": c, "batch": b, "engine_tok_s": 10.0 * b, "bare_tok_s": 12.0 * b}
        for c, b in bench.cells([1, 4], [128, 1024], 1024)
    ]
    path = bench.chart(records, tmp_path / "s.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cell_summarizes_its_repeats_by_medians_and_paired_ratios() -> None:
    record = bench.summarize(1024, 8, [0.010, 0.030, 0.012], [0.008, 0.015, 0.012])
    assert record["engine_step_ms"] == pytest.approx(12.0)
    assert record["bare_step_ms"] == pytest.approx(12.0)
    assert record["overhead_step_ms"] == pytest.approx(0.0)
    assert record["engine_tok_s"] == pytest.approx(8 / 0.012)
    # Paired by repeat: 0.8, 0.5, 1.0; the median of the pairs, not a ratio of medians.
    assert record["engine_over_bare_each"] == pytest.approx([0.8, 0.5, 1.0])
    assert record["engine_over_bare"] == pytest.approx(0.8)


def test_a_repeat_drowned_in_noise_gives_no_ratio() -> None:
    record = bench.summarize(128, 1, [0.0, 0.010], [0.005, 0.005])
    assert record["engine_over_bare_each"] == pytest.approx([0.5])
    assert math.isnan(bench.summarize(128, 1, [0.0], [0.005])["engine_tok_s"])
    assert math.isnan(bench.summarize(128, 1, [0.0], [0.005])["engine_over_bare"])
