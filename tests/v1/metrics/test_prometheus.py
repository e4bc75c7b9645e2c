"""Tests for vllm/v1/metrics/prometheus.py: a step's outputs recorded at once."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from vllm.v1.metrics.prometheus import PrometheusMetrics, observe_many
from vllm.v1.metrics.stats import RequestStateStats

MODEL = "test-model"
BOUNDS = (0.01, 0.1, 1.0)


def _histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    family = Histogram("lat", "latency", ["model_name"], buckets=BOUNDS, registry=registry)
    return registry, family.labels(MODEL)


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    """{(sample name, le label or ''): value} of the metric family `name`."""
    from prometheus_client import generate_latest

    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if family.name == name:
            for s in family.samples:
                out[(s.name, s.labels.get("le", ""))] = s.value
    return out


@pytest.mark.parametrize("value", [0.0, 0.005, 0.01, 0.05, 1.0, 3.0])
@pytest.mark.parametrize("count", [1, 3])
def test_observe_many_records_what_repeated_observe_records(value: float, count: int) -> None:
    # Values on a bucket's bound (0.01, 1.0) and past the last one (+Inf) included.
    many_registry, many = _histogram()
    loop_registry, loop = _histogram()
    observe_many(many, value, count)
    for _ in range(count):
        loop.observe(value)
    got, want = _samples(many_registry, "lat"), _samples(loop_registry, "lat")
    assert got.keys() == want.keys()
    for key, expected in want.items():
        assert got[key] == pytest.approx(expected), key


def _metric(metrics: PrometheusMetrics, sample_name: str, le: str = "") -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == sample_name and s.labels.get("le", "") == le:
                return s.value
    raise KeyError(sample_name)


def test_record_outputs_counts_tokens_ttft_and_inter_token_latencies() -> None:
    metrics = PrometheusMetrics(MODEL)
    a, b, c = (RequestStateStats(arrival_time=0.0, num_prompt_tokens=4) for _ in range(3))
    # Step at t=1: first tokens of a and b (two TTFTs, no inter-token latency); c only
    # learns its first-scheduled time.
    metrics.record_outputs([(a, 0.5, 1), (b, 0.5, 1), (c, 0.75, 0)], 1.0)
    assert c.first_scheduled_time == 0.75 and c.first_token_time is None
    # Step at t=1.03: a and b get one token each (equal gaps of 0.03), c its first.
    metrics.record_outputs([(a, None, 1), (b, None, 1), (c, None, 1)], 1.03)
    # Step at t=1.5: a gets two tokens (kept drafts), c one; b none.
    metrics.record_outputs([(a, None, 2), (c, None, 1), (b, None, 0)], 1.5)
    assert _metric(metrics, "vllm:generation_tokens_total") == 8
    assert _metric(metrics, "vllm:time_to_first_token_seconds_count") == 3
    itl = "vllm:inter_token_latency_seconds"
    assert _metric(metrics, f"{itl}_count") == 4
    assert _metric(metrics, f"{itl}_sum") == pytest.approx(2 * 0.03 + 0.47 + 0.47)
    assert _metric(metrics, f"{itl}_bucket", "0.01") == 0
    assert _metric(metrics, f"{itl}_bucket", "0.05") == 2  # cumulative: the two 0.03 gaps
    assert _metric(metrics, f"{itl}_bucket", "0.5") == 4
    assert (a.num_generation_tokens, b.num_generation_tokens, c.num_generation_tokens) == (4, 2, 2)
    assert a.last_token_time == 1.5 and b.last_token_time == 1.03


def _by_engine(metrics: PrometheusMetrics, sample_name: str, **labels: str) -> dict[str, float]:
    """{engine label: value} of the samples `sample_name` whose labels include `labels`."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == sample_name and labels.items() <= s.labels.items():
                out[s.labels["engine"]] = s.value
    return out


def test_steps_and_finished_requests_are_counted_per_engine() -> None:
    metrics = PrometheusMetrics(MODEL, max_model_len=64, num_engines=2)
    a = RequestStateStats(arrival_time=0.0, num_prompt_tokens=5, max_tokens=3)
    b = RequestStateStats(arrival_time=0.0, num_prompt_tokens=7, num_seqs=2, max_tokens=9)
    # Engine 1 finishes a's prefill (5 prompt tokens + 1 new) and decodes twice.
    metrics.record_outputs([(a, 0.25, 1)], 1.0, engine_index=1)
    metrics.record_outputs([(a, None, 1)], 1.5, engine_index=1)
    metrics.record_outputs([(a, None, 1)], 2.0, engine_index=1)
    # Engine 0: b's two sequences get their first tokens in one step, then one more each.
    metrics.record_outputs([(b, 0.5, 1), (b, None, 1)], 1.0, engine_index=0)
    metrics.record_outputs([(b, None, 1), (b, None, 1)], 1.25, engine_index=0)
    assert (a.engine_index, b.engine_index) == (1, 0)
    metrics.record_finished(a.finish("length", 2.0))
    metrics.record_finished(b.finish("stop", 1.25))
    iteration = "vllm:iteration_tokens_total"
    assert _by_engine(metrics, f"{iteration}_count") == {"0": 2, "1": 3}
    assert _by_engine(metrics, f"{iteration}_sum") == {"0": 7 + 2 + 2, "1": 5 + 1 + 1 + 1}
    assert _by_engine(metrics, "vllm:prompt_tokens_total") == {"0": 7, "1": 5}
    assert _by_engine(metrics, "vllm:generation_tokens_total") == {"0": 4, "1": 3}
    success = "vllm:request_success_total"
    assert _by_engine(metrics, success, finished_reason="length") == {"0": 0, "1": 1}
    assert _by_engine(metrics, success, finished_reason="stop") == {"0": 1, "1": 0}
    assert _by_engine(metrics, "vllm:request_params_n_sum") == {"0": 2, "1": 1}
    assert _by_engine(metrics, "vllm:request_params_max_tokens_sum") == {"0": 9, "1": 3}
    assert _by_engine(metrics, "vllm:request_params_max_tokens_count") == {"0": 1, "1": 1}
    inference = "vllm:request_inference_time_seconds_sum"
    assert _by_engine(metrics, inference) == pytest.approx({"0": 1.25 - 0.5, "1": 2.0 - 0.25})
    tpot = "vllm:request_time_per_output_token_seconds_sum"
    assert _by_engine(metrics, tpot) == _by_engine(
        metrics, "vllm:time_per_output_token_seconds_sum")
