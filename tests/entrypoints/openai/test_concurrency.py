"""200 concurrent streaming clients, a quarter of which hang up mid-stream."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

MODEL = "demo-tiny"
NUM_CLIENTS = 200
NUM_DISCONNECT = NUM_CLIENTS // 4
MAX_TOKENS = 12
# Long enough that a client that hung up would still be generating if it were not aborted.
DISCONNECT_MAX_TOKENS = 400


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(MODEL, "--max-model-len", "512", "--max-num-seqs", "256",
                        "--disable-log-requests", "--uvicorn-log-level", "warning")


@pytest.mark.slow
def test_concurrent_streams_with_disconnects(server):
    before = server.metrics()
    client = server.async_client()

    async def complete(i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"story {i}"}],
            max_tokens=MAX_TOKENS, temperature=1.0, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
        return finish, usage.completion_tokens

    async def hang_up(i: int) -> int:
        stream = await client.completions.create(
            model=MODEL, prompt=f"long story {i}", max_tokens=DISCONNECT_MAX_TOKENS,
            temperature=1.0, seed=i, stream=True, extra_body={"ignore_eos": True},
        )
        received = 0
        async with stream:
            async for _ in stream:
                received += 1
                if received == 2:
                    break  # leaving the block closes the connection mid-stream
        return received

    async def run():
        jobs = [hang_up(i) if i % 4 == 0 else complete(i) for i in range(NUM_CLIENTS)]
        return await asyncio.gather(*jobs)

    start = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - start
    completed = [r for i, r in enumerate(results) if i % 4 != 0]
    hung_up = [r for i, r in enumerate(results) if i % 4 == 0]
    assert len(hung_up) == NUM_DISCONNECT
    assert all(r == 2 for r in hung_up)
    assert completed == [("length", MAX_TOKENS)] * (NUM_CLIENTS - NUM_DISCONNECT)

    m = server.wait_idle(timeout_s=30)
    print(f"\n{NUM_CLIENTS} streams ({NUM_DISCONNECT} hung up) in {elapsed:.1f} s")
    # Every hung-up request was still alive in the engine and got aborted there.
    aborted = m["vllm:engine_aborted_requests_total"] - before.get(
        "vllm:engine_aborted_requests_total", 0.0)
    assert aborted == NUM_DISCONNECT
    key = 'vllm:request_success_total{finished_reason="abort",model_name="demo-tiny"}'
    assert m[key] - before.get(key, 0.0) == NUM_DISCONNECT
    generated = m["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0)
    # Aborted requests stopped early: far fewer tokens than their max_tokens.
    assert generated < (NUM_CLIENTS - NUM_DISCONNECT) * MAX_TOKENS + NUM_DISCONNECT * 100
    assert m["vllm:kv_cache_free_blocks"] == m["vllm:kv_cache_total_blocks"]
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
    assert m["vllm:num_requests_api_server"] == 0
    assert httpx.get(server.url("/health"), timeout=30).status_code == 200
    # Still serving normally.
    out = server.client().completions.create(model=MODEL, prompt="after", max_tokens=3)
    assert out.usage.completion_tokens == 3
