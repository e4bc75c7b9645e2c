"""Tests for benchmarks/bench_burst.py's arithmetic (the burst itself runs a server for a
minute; the README and the closing notes give its command)."""

from __future__ import annotations

import pytest

from tests.benchmarks.scripts import load_script

bench_burst = load_script("bench_burst")


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([], 0.99, 0.0), ([1.0], 0.99, 1.0), ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
    ([float(i) for i in range(1, 101)], 0.99, 99.0),
    ([float(i) for i in range(1, 101)], 0.50, 50.0)])
def test_percentile_is_nearest_rank(values, q, expected) -> None:
    assert bench_burst.percentile(values, q) == expected


def test_waiting_sums_every_engine() -> None:
    text = ('vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 4.0\n'
            'vllm:num_requests_waiting_other 100.0\n'
            '# HELP vllm:num_requests_waiting waiting\n')
    assert bench_burst.waiting(text) == 7.0


def test_summary_counts_statuses() -> None:
    result = bench_burst.BurstResult(statuses={200: 3, 503: 5, 500: 1},
                                     admitted_latency_s=[0.3, 0.1, 0.2])
    summary = result.summary()
    assert (summary["ok_200"], summary["shed_503"], summary["other"]) == (3, 5, 1)
    assert summary["p50_s"] == 0.2 and summary["max_s"] == 0.3
