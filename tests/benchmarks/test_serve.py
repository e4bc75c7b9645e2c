"""Tests for vllm/benchmarks/serve.py (`vllm bench serve`) against a fake server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
from pathlib import Path

import pytest

from vllm.benchmarks import serve
from vllm.benchmarks.datasets import SampleRequest, StructuredSpec
from vllm.benchmarks.endpoint_request_func import request_completions


def parse(argv: list[str]) -> argparse.Namespace:
    return serve.add_cli_args(argparse.ArgumentParser()).parse_args(argv)


def test_arrival_offsets_poisson_and_gamma() -> None:
    assert serve.arrival_offsets(4, math.inf) == [0.0] * 4
    n, rate = 4000, 50.0
    for burstiness in (1.0, 0.25, 4.0):
        offsets = serve.arrival_offsets(n, rate, burstiness, seed=1)
        gaps = [b - a for a, b in zip(offsets, offsets[1:])]
        assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
        # Gamma(k, 1/(rate k)): mean 1/rate, coefficient of variation 1/sqrt(k).
        assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.1)
        cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)
    assert serve.arrival_offsets(10, 5.0, seed=3) == serve.arrival_offsets(10, 5.0, seed=3)
    assert serve.arrival_offsets(10, 5.0, seed=3) != serve.arrival_offsets(10, 5.0, seed=4)
    with pytest.raises(ValueError, match="request_rate"):
        serve.arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        serve.arrival_offsets(3, 1.0, 0.0)


def test_request_body_extras() -> None:
    plain = SampleRequest("p", 1, 4)
    shaped = SampleRequest("p", 1, 4, StructuredSpec("regex", "a+"))
    assert serve.request_body_extras(plain, None) is None
    assert serve.request_body_extras(plain, {"top_k": 3}) == {"top_k": 3}
    assert serve.request_body_extras(shaped, {"top_k": 3}) == {
        "top_k": 3, "structured_outputs": {"regex": "a+"}
    }


def test_max_concurrency_caps_requests_in_flight(fake_server) -> None:
    fake_server.reset()
    reqs = [SampleRequest(f"p{i}", 2, 4) for i in range(6)]
    result = asyncio.run(serve.run_requests(
        reqs, request_completions, fake_server.url + "/v1/completions", "fake-model",
        max_concurrency=2, extra_body={"fake_ttft": 0.05}, disable_tqdm=True,
        initial_test=False,
    ))
    assert all(o.success for o in result.outputs)
    assert fake_server.peak_in_flight == 2
    assert len(fake_server.requests) == 6
    # Three waves of two requests, each at least 50 ms.
    assert result.duration_s >= 0.15


def test_request_rate_spreads_arrivals(fake_server) -> None:
    fake_server.reset()
    reqs = [SampleRequest("p", 2, 2) for _ in range(5)]
    result = asyncio.run(serve.run_requests(
        reqs, request_completions, fake_server.url + "/v1/completions", "fake-model",
        request_rate=20.0, burstiness=1.0, seed=0, disable_tqdm=True,
    ))
    offsets = serve.arrival_offsets(5, 20.0, 1.0, seed=0)
    assert len(fake_server.requests) == 6  # the initial test request plus five
    assert result.duration_s >= offsets[-1]
    starts = [o.start_time for o in result.outputs]
    for (a, b), (oa, ob) in zip(zip(starts, starts[1:]), zip(offsets, offsets[1:])):
        assert b - a >= (ob - oa) - 0.01


def test_failed_initial_test_stops_the_run(fake_server) -> None:
    reqs = [SampleRequest("p", 2, 2)]
    with pytest.raises(RuntimeError, match="initial test request failed"):
        asyncio.run(serve.run_requests(
            reqs, request_completions, fake_server.url + "/v1/completions", "fake-model",
            extra_body={"fake_status": 500}, disable_tqdm=True,
        ))


def test_bench_serve_main_random(fake_server, char_tokenizer, monkeypatch, tmp_path: Path, capsys) -> None:
    fake_server.reset()
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: char_tokenizer)
    args = parse([
        "--base-url", fake_server.url, "--num-prompts", "5", "--random-input-len", "12",
        "--random-output-len", "3", "--extra-body", '{"top_k": 7}', "--disable-tqdm",
        "--goodput", "ttft:10000", "--percentile-metrics", "ttft,e2el",
        "--metric-percentiles", "50,99", "--save-results", "--result-dir", str(tmp_path),
        "--result-filename", "r.json",
    ])
    record = serve.main(args)
    assert record["model"] == "fake-model"  # from /v1/models
    assert record["completed"] == 5 and record["failed"] == 0
    assert record["total_output_tokens"] == 15
    assert record["request_goodput"] == pytest.approx(record["request_throughput"])
    assert {"p50_ttft_ms", "p99_e2el_ms"} <= set(record)
    assert all(r["top_k"] == 7 and r["max_tokens"] == 3 for r in fake_server.requests)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 5 and saved["input_lens"] == record["input_lens"]
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_serve_main_custom(fake_server, char_tokenizer, monkeypatch, tmp_path: Path) -> None:
    fake_server.reset()
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: char_tokenizer)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"q{i}"}) for i in range(3)))
    args = parse([
        "--base-url", fake_server.url, "--endpoint", "/v1/chat/completions", "--model", "m",
        "--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", "3",
        "--custom-output-len", "2", "--disable-tqdm", "--no-shuffle",
    ])
    record = serve.main(args)
    assert record["completed"] == 3 and record["model"] == "m"
    prompts = [r["messages"][0]["content"] for r in fake_server.requests[1:]]
    assert prompts == ["q0", "q1", "q2"]


def test_bad_flags_raise_value_errors() -> None:
    for argv, field in [
        (["--num-prompts", "0"], "--num-prompts"),
        (["--request-rate", "0"], "--request-rate"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--endpoint", "/v1/embeddings"], "endpoint"),
        (["--goodput", "foo:1"], "goodput"),
    ]:
        with pytest.raises(ValueError, match=field):
            serve.check_common_args(parse(argv))
    with pytest.raises(ValueError, match="extra_body"):
        serve.parse_extra_body("[1, 2]")
    assert serve.parse_extra_body('{"a": 1}') == {"a": 1}


def test_urls() -> None:
    args = parse(["--host", "h", "--port", "9", "--endpoint", "v1/completions"])
    assert serve.api_url(args) == "http://h:9/v1/completions"
    args = parse(["--base-url", "http://x:1/", "--endpoint", "/v1/chat/completions"])
    assert serve.api_url(args) == "http://x:1/v1/chat/completions"
    assert serve.base_url(args) == "http://x:1"


def test_load_tokenizer_by_demo_name() -> None:
    tok = serve.load_tokenizer("demo-tiny")
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    with pytest.raises(ValueError, match="tokenizer"):
        serve.load_tokenizer("no-such-model-name")


def test_load_tokenizer_by_the_served_id_of_the_default_model(monkeypatch) -> None:
    # What the client passes when --model is the server's own id: with no hub, the id
    # resolves to the packaged model as it does for the server.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = serve.load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert len(tok) == 49_152 and tok.eos_token == "<|im_end|>"


def test_spec_decode_summary_from_the_servers_metrics_text() -> None:
    from vllm.benchmarks.serve import (
        format_spec_decode,
        parse_spec_decode_counters,
        spec_decode_summary,
    )
    from vllm.v1.metrics.engine_stats import EngineCoreStats, SpecDecodeStats
    from vllm.v1.metrics.prometheus import PrometheusMetrics

    def rendered(steps: int, drafted: int, kept: int) -> str:
        metrics = PrometheusMetrics("m")
        metrics.record_engine_stats(EngineCoreStats(
            num_running=0, num_waiting=0, num_preemptions=0, num_aborted_requests=0,
            timestamp=0.0, spec=SpecDecodeStats(num_steps=steps, num_draft_tokens=drafted,
                                                num_accepted_tokens=kept)))
        return metrics.render().decode()

    before = parse_spec_decode_counters(rendered(10, 30, 12))
    assert before == {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 30,
                      "vllm:spec_decode_num_accepted_tokens": 12}
    after = parse_spec_decode_counters(rendered(30, 90, 52))
    summary = spec_decode_summary(before, after)
    # Over the run: 20 verifications, 60 drafted tokens, 40 kept.
    assert summary == {"draft_tokens": 60, "accepted_tokens": 40,
                       "acceptance_rate": 40 / 60, "mean_accepted_length": 1 + 40 / 20}
    assert "Draft acceptance rate:" in format_spec_decode(summary)
    assert spec_decode_summary(after, after) is None  # nothing drafted during the run
    assert spec_decode_summary({}, {}) is None  # a server without the counters
    assert format_spec_decode(None) == ""
