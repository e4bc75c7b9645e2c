"""Upstream vLLM's API surfaces beyond chat and completions, against one real server
(demo-think with `--reasoning-parser qwen3`, tool calling and an API key): the metric names
upstream's dashboards read, /tokenize and /detokenize, and /v1/responses."""

from __future__ import annotations

import httpx
import pytest

MODEL = "demo-think"
API_KEY = "sk-upstream"
PHASE_HISTOGRAMS = (
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(MODEL, "--max-model-len", "1024", "--reasoning-parser", "qwen3",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        api_key=API_KEY)


def test_upstream_request_histograms_count_every_request(server) -> None:
    before = server.wait_idle()
    client = server.client()
    num_requests, produced, prompt_tokens = 3, 0, 0
    for i in range(num_requests):
        reply = client.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=5 + i,
                                          temperature=0)
        produced += reply.usage.completion_tokens
        prompt_tokens += reply.usage.prompt_tokens
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for name in PHASE_HISTOGRAMS:
        assert delta(f"{name}_count") == num_requests, name
    assert delta("vllm:request_generation_tokens_sum") == produced
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    # Every token after a request's first comes with an inter-token observation at most
    # once per step, so there is at least one and at most (tokens - first tokens).
    itl = delta("vllm:inter_token_latency_seconds_count")
    assert 1 <= itl <= produced - num_requests
    assert delta("vllm:request_queue_time_seconds_sum") >= 0
    assert delta("vllm:request_decode_time_seconds_sum") > 0
