"""Tests for vllm/entrypoints/openai/request_body.py: request bodies are decoded and
validated on the event loop when small and in a worker thread when large, with the same
answers either way."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from fastapi.responses import JSONResponse
from starlette.requests import Request

from vllm.entrypoints.openai import request_body
from vllm.entrypoints.openai.protocol import DetokenizeRequest
from vllm.entrypoints.openai.request_body import OFF_LOOP_PARSE_BYTES, parse_request, read_json_body


def _request(body: bytes) -> Request:
    """A POST request whose body arrives in one message."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/detokenize",
             "headers": [(b"content-length", str(len(body)).encode())]}
    return Request(scope, receive)


def _body(num_tokens: int) -> bytes:
    return json.dumps({"tokens": [7] * num_tokens}).encode()


@pytest.fixture
def decode_threads(monkeypatch) -> list[int]:
    """The thread each body decode ran on, in order."""
    threads: list[int] = []
    decode = request_body.decode_json_body

    def recording(body: bytes) -> Any:
        threads.append(threading.get_ident())
        return decode(body)

    monkeypatch.setattr(request_body, "decode_json_body", recording)
    return threads


@pytest.mark.parametrize("reader", ["parse_request", "read_json_body"])
def test_a_large_body_is_parsed_off_the_event_loop(decode_threads, reader) -> None:
    small, large = _body(10), _body(OFF_LOOP_PARSE_BYTES // 2)
    assert len(small) <= OFF_LOOP_PARSE_BYTES < len(large)

    async def main() -> tuple[int, list[Any]]:
        results = []
        for body in (small, large):
            if reader == "parse_request":
                results.append(await parse_request(_request(body), DetokenizeRequest))
            else:
                results.append(await read_json_body(_request(body), 1 << 30))
        return threading.get_ident(), results

    loop_thread, (small_result, large_result) = asyncio.run(main())
    assert decode_threads[0] == loop_thread
    assert decode_threads[1] != loop_thread
    if reader == "parse_request":
        assert small_result.tokens == [7] * 10
        assert large_result.tokens == [7] * (OFF_LOOP_PARSE_BYTES // 2)
    else:
        assert large_result == {"tokens": [7] * (OFF_LOOP_PARSE_BYTES // 2)}


@pytest.mark.parametrize("size", [10, OFF_LOOP_PARSE_BYTES])
def test_bad_bodies_get_the_same_400_on_and_off_the_loop(size) -> None:
    # Invalid JSON, and valid JSON with a field of the wrong type, padded past the threshold.
    pad = " " * size
    bad_json = _request(b'{"tokens": [1, 2' + pad.encode())
    bad_field = _request(b'{"tokens": "abc"}' + pad.encode())

    async def main() -> list[JSONResponse]:
        return [await parse_request(bad_json, DetokenizeRequest),
                await parse_request(bad_field, DetokenizeRequest),
                await read_json_body(_request(b"[1, 2" + pad.encode()), 1 << 30)]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [400, 400, 400]
    assert json.loads(responses[1].body)["error"]["param"] == "tokens"
    assert "Invalid JSON body" in json.loads(responses[0].body)["error"]["message"]


def test_a_body_over_the_limit_is_a_413_before_parsing(decode_threads) -> None:
    response = asyncio.run(read_json_body(_request(_body(100)), 64))
    assert response.status_code == 413 and "64 bytes" in response.body.decode()
    assert decode_threads == []
