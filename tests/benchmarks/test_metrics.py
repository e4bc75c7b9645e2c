"""Tests for vllm/benchmarks/metrics.py against hand-computed oracles."""

from __future__ import annotations

import math
import statistics

import pytest

from vllm.benchmarks.endpoint_request_func import RequestFuncOutput
from vllm.benchmarks.metrics import (
    calculate_metrics,
    format_report,
    output_token_count,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    summarize,
)


def linear_percentile(values: list[float], p: float) -> float:
    """Percentile with linear interpolation between closest ranks (the textbook definition)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def make_output(ttft: float, itl: list[float], tokens: int | None, prompt_len: int = 10) -> RequestFuncOutput:
    return RequestFuncOutput(
        generated_text="x" * (1 + len(itl)),
        success=True,
        latency=ttft + sum(itl),
        ttft=ttft,
        itl=list(itl),
        prompt_len=prompt_len,
        output_tokens=tokens,
        finish_reason="length",
    )


@pytest.fixture
def outputs() -> list[RequestFuncOutput]:
    return [
        make_output(0.10, [0.02, 0.03, 0.01], tokens=4, prompt_len=10),
        make_output(0.20, [0.05], tokens=2, prompt_len=20),
        make_output(0.05, [0.01] * 9, tokens=10, prompt_len=5),
        RequestFuncOutput(success=False, error="HTTP 500", prompt_len=7),
    ]


def test_throughput_and_counts(outputs: list[RequestFuncOutput]) -> None:
    m = calculate_metrics(outputs, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 35  # the failed request's prompt does not count
    assert m.total_output_tokens == 16
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(8.0)
    assert m.total_token_throughput == pytest.approx(25.5)
    assert m.request_goodput is None


def test_latency_statistics(outputs: list[RequestFuncOutput]) -> None:
    m = calculate_metrics(
        outputs, 2.0, selected_metrics=("ttft", "tpot", "itl", "e2el"), percentiles=(50, 90, 99)
    )
    ok = [o for o in outputs if o.success]
    series = {
        "ttft": [o.ttft for o in ok],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok],
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    for name, values in series.items():
        ms = [v * 1000 for v in values]
        s = m.stats[name]
        assert s.mean == pytest.approx(statistics.fmean(ms)), name
        assert s.median == pytest.approx(statistics.median(ms)), name
        assert s.std == pytest.approx(statistics.pstdev(ms)), name
        for p, value in s.percentiles:
            assert value == pytest.approx(linear_percentile(ms, p)), (name, p)


def test_tpot_is_per_token_after_the_first() -> None:
    out = make_output(0.5, [0.1, 0.1, 0.1, 0.1], tokens=5)
    m = calculate_metrics([out], 1.0, selected_metrics=("tpot",))
    assert m.stats["tpot"].mean == pytest.approx(100.0)


def test_single_token_requests_have_no_tpot() -> None:
    out = make_output(0.5, [], tokens=1)
    m = calculate_metrics([out], 1.0, selected_metrics=("tpot", "ttft"))
    assert m.stats["tpot"].mean == 0.0
    assert m.stats["ttft"].mean == pytest.approx(500.0)


def test_goodput_counts_requests_meeting_every_slo(outputs: list[RequestFuncOutput]) -> None:
    # TTFTs 100, 200, 50 ms; TPOTs 20, 50, 10 ms.
    m = calculate_metrics(outputs, 2.0, goodput={"ttft": 150.0})
    assert m.request_goodput == pytest.approx(2 / 2.0)
    m = calculate_metrics(outputs, 2.0, goodput={"ttft": 150.0, "tpot": 15.0})
    assert m.request_goodput == pytest.approx(1 / 2.0)
    m = calculate_metrics(outputs, 2.0, goodput={"e2el": 1.0})
    assert m.request_goodput == 0.0


def test_output_tokens_fall_back_to_the_tokenizer_then_chunks() -> None:
    out = make_output(0.1, [0.1, 0.1], tokens=None)
    assert output_token_count(out, lambda text: 7) == 7
    assert output_token_count(out) == 3
    out.output_tokens = 11
    assert output_token_count(out, lambda text: 7) == 11


def test_empty_summary_and_bad_duration() -> None:
    s = summarize([], (50.0, 99.0))
    assert (s.mean, s.median, s.percentiles) == (0.0, 0.0, [(50.0, 0.0), (99.0, 0.0)])
    with pytest.raises(ValueError, match="duration_s"):
        calculate_metrics([], 0.0)


def test_parsers() -> None:
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    assert parse_metric_names("ttft,e2el") == ["ttft", "e2el"]
    assert parse_goodput(["ttft:300", "tpot:50.5"]) == {"ttft": 300.0, "tpot": 50.5}
    assert parse_goodput(None) == {}
    for bad, fn in [
        ("0", parse_percentiles), ("101", parse_percentiles), ("x", parse_percentiles),
        ("ttft,foo", parse_metric_names),
    ]:
        with pytest.raises(ValueError):
            fn(bad)
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_report_and_dict(outputs: list[RequestFuncOutput]) -> None:
    m = calculate_metrics(outputs, 2.0, percentiles=(99.0, 99.9), goodput={"ttft": 150.0})
    d = m.to_dict()
    assert d["p99_ttft_ms"] == m.stats["ttft"].percentiles[0][1]
    assert "p99.9_itl_ms" in d and "stats" not in d
    text = format_report(m)
    assert "Request throughput (req/s):" in text and "1.50" in text
    assert "Request goodput (req/s):" in text
    assert "P99.9 ITL (ms):" in text
