"""`LLM.get_metrics()`: upstream's reader objects, read from the offline engine's own stats."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Metric


@pytest.fixture(scope="module")
def llms():
    first = LLM("demo-tiny", max_model_len=128, max_num_seqs=4, seed=0)
    second = LLM("demo-tiny", max_model_len=128, max_num_seqs=4, seed=0)
    yield first, second
    first.shutdown()
    second.shutdown()


def by_name(metrics: list[Metric]) -> dict[str, Metric]:
    return {m.name: m for m in metrics}


def test_get_metrics_counts_this_engines_requests_only(llms) -> None:
    first, second = llms
    outs = first.generate(["a", "b c", "d e f"], SamplingParams(max_tokens=4, temperature=0),
                          use_tqdm=False)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    prompts = sum(len(o.prompt_token_ids) for o in outs)
    metrics = by_name(first.get_metrics())
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:e2e_request_latency_seconds",
                 "vllm:time_to_first_token_seconds"):
        hist = metrics[name]
        assert isinstance(hist, Histogram), name
        assert hist.count == 3, name
        assert hist.labels == {"model_name": "demo-tiny", "engine": "0"}
        assert hist.buckets["+Inf"] == 3
    assert metrics["vllm:request_generation_tokens"].sum == produced
    assert metrics["vllm:request_prompt_tokens"].sum == prompts
    generation = metrics["vllm:generation_tokens"]
    assert isinstance(generation, Counter) and generation.value == produced
    assert isinstance(metrics["vllm:num_requests_running"], Gauge)
    assert metrics["vllm:num_requests_running"].value == 0
    # Upstream's request-parameter and step histograms: one observation per request
    # (max_tokens 4 each) and per step (its prompt tokens finished + tokens generated).
    assert metrics["vllm:request_params_max_tokens"].count == 3
    assert metrics["vllm:request_params_max_tokens"].sum == 3 * 4
    assert metrics["vllm:request_params_n"].sum == 3
    assert metrics["vllm:iteration_tokens_total"].sum == prompts + produced
    assert metrics["vllm:request_inference_time_seconds"].count == 3
    finished = {m.labels["finished_reason"]: m.value for m in first.get_metrics()
                if m.name == "vllm:request_success"}
    lengths = sum(o.outputs[0].finish_reason == "length" for o in outs)
    assert finished["length"] == lengths and sum(finished.values()) == 3
    info = metrics["vllm:cache_config_info"]
    assert info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0
    # The other engine in this process saw nothing.
    other = by_name(second.get_metrics())
    assert other["vllm:request_prompt_tokens"].count == 0
    assert other["vllm:generation_tokens"].value == 0


def test_reader_shapes_from_a_plain_registry() -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as PromCounter
    from prometheus_client import Histogram as PromHistogram

    from vllm.v1.metrics.reader import Vector, get_metrics_snapshot

    reg = CollectorRegistry()
    per_pos = PromCounter("vllm:accepted_per_pos", "x", ["model_name", "position"], registry=reg)
    per_pos.labels("m", "0").inc(3)
    per_pos.labels("m", "2").inc(1)
    hist = PromHistogram("vllm:h", "x", ["model_name"], buckets=(1, 5), registry=reg)
    hist.labels("m").observe(2)
    hist.labels("m").observe(7)
    PromCounter("other_metric", "x", registry=reg).inc()
    metrics = by_name(get_metrics_snapshot(reg))
    assert set(metrics) == {"vllm:accepted_per_pos", "vllm:h"}
    vector = metrics["vllm:accepted_per_pos"]
    assert isinstance(vector, Vector) and vector.values == [3, 0, 1]
    assert vector.labels == {"model_name": "m"}
    h = metrics["vllm:h"]
    assert (h.count, h.sum, h.buckets) == (2, 9.0, {"1.0": 0, "5.0": 1, "+Inf": 2})
