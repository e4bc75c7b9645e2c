"""Tests for vllm/benchmarks/endpoint_request_func.py against a fake SSE server."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from vllm.benchmarks.endpoint_request_func import (
    RequestFuncInput,
    RequestFuncOutput,
    chat_payload,
    completions_payload,
    get_request_func,
    request_chat_completions,
    request_completions,
)


def send(func, inp: RequestFuncInput) -> RequestFuncOutput:
    async def go() -> RequestFuncOutput:
        async with aiohttp.ClientSession() as session:
            return await func(inp, session)

    return asyncio.run(go())


def make_input(url: str, extra: dict[str, Any] | None = None, output_len: int = 100) -> RequestFuncInput:
    return RequestFuncInput(
        prompt="hi", api_url=url, prompt_len=2, output_len=output_len, model="fake-model",
        extra_body=extra,
    )


def test_payloads_merge_extra_body() -> None:
    inp = make_input("u", {"top_k": 5, "temperature": 0.7})
    inp.ignore_eos = True
    body = completions_payload(inp)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 100 and body["ignore_eos"] is True
    assert body["top_k"] == 5 and body["temperature"] == 0.7  # extra body wins
    chat = chat_payload(inp)
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["max_completion_tokens"] == 100


def test_completion_stream_text_timing_and_usage(fake_server) -> None:
    fake_server.reset()
    extra = {"structured_outputs": {"choice": ["positive", "negative"]}, "fake_ttft": 0.05}
    out = send(request_completions, make_input(fake_server.url + "/v1/completions", extra))
    assert out.success and out.error == ""
    assert out.generated_text == "positive"
    assert out.output_tokens == 2  # two 4-character chunks
    assert out.finish_reason == "stop"
    assert out.ttft >= 0.05
    assert len(out.itl) == 1 and out.latency >= out.ttft + out.itl[0]
    assert fake_server.requests[-1]["structured_outputs"] == {"choice": ["positive", "negative"]}


def test_inter_token_latencies(fake_server) -> None:
    extra = {"fake_itl": 0.02}
    out = send(request_completions, make_input(fake_server.url + "/v1/completions", extra, output_len=6))
    assert out.success and out.finish_reason == "length"
    assert out.generated_text == ("word " * 64)[:24]
    assert len(out.itl) == 5 and all(gap >= 0.015 for gap in out.itl)
    assert out.output_tokens == 6


def test_chat_stream(fake_server) -> None:
    extra = {"structured_outputs": {"regex": "x"}}
    out = send(request_chat_completions, make_input(fake_server.url + "/v1/chat/completions", extra))
    assert out.success and out.generated_text == "ada.lovelace@analytical.com"
    assert out.output_tokens == 7
    assert fake_server.requests[-1]["messages"][0]["content"] == "hi"


def test_missing_usage_leaves_tokens_unknown(fake_server) -> None:
    out = send(request_completions, make_input(fake_server.url + "/v1/completions", {"fake_no_usage": True}, 3))
    assert out.success and out.output_tokens is None and len(out.itl) == 2


def test_errors_are_reported_not_raised(fake_server) -> None:
    out = send(request_completions, make_input(fake_server.url + "/v1/completions", {"fake_status": 400}))
    assert not out.success and out.error.startswith("HTTP 400") and "boom" in out.error
    out = send(request_completions, make_input("http://127.0.0.1:1/v1/completions"))
    assert not out.success and "ClientConnectorError" in out.error


def test_request_func_by_endpoint() -> None:
    assert get_request_func("/v1/completions") is request_completions
    assert get_request_func("/v1/chat/completions/") is request_chat_completions
    with pytest.raises(ValueError, match="endpoint"):
        get_request_func("/v1/embeddings")
