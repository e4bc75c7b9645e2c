"""Fixtures for the benchmark tests: a character-level tokenizer and a fake OpenAI server.

The fake server streams SSE like a vLLM server, answers structured requests with outputs that
satisfy (or, on request, violate) their constraint, and records what it received.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

# Valid under the default shipped schema, assets.builtin_schema() (checked by a test).
VALID_PROFILE: dict[str, Any] = {
    "name": "Ada",
    "email": "ada.l@analytic.org",
    "age": 36,
    "is_active": True,
    "role": "admin",
    "address": {"street": "1 Main St", "city": "London", "zip": "12345"},
    "tags": ["math"],
}
CHUNK_CHARS = 4


class CharTokenizer:
    """One token per character (ids are code points below 4096)."""

    vocab_size = 4096

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids: list[int]) -> str:
        # Printable characters only, so re-encoding gives the same length.
        return "".join(chr(0x41 + i % 26) for i in ids)


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture
def valid_profile() -> dict[str, Any]:
    """A document valid under the default schema."""
    return json.loads(json.dumps(VALID_PROFILE))


def answer_text(payload: dict[str, Any]) -> str:
    """The full text the fake server generates for a request."""
    structured_outputs = payload.get("structured_outputs") or {}
    invalid = bool(payload.get("fake_invalid"))
    if "json" in structured_outputs:
        doc = dict(VALID_PROFILE)
        for name in structured_outputs["json"].get("required", []):
            if name.startswith("flag_"):
                doc[name] = True
        text = json.dumps(doc, separators=(",", ":"))
        return text[:-1] if invalid else text
    if "regex" in structured_outputs:
        return "ada lovelace" if invalid else "ada.lovelace@analytical.com"
    if "choice" in structured_outputs:
        return "maybe" if invalid else structured_outputs["choice"][0]
    if "grammar" in structured_outputs:
        return "SELECT FROM users" if invalid else "SELECT username, email FROM users;"
    return "word " * 64


@dataclass
class FakeServer:
    """Handle of a running fake server: its URL, what it received, its peak concurrency."""

    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0

    def reset(self) -> None:
        self.requests.clear()
        self.in_flight = self.peak_in_flight = 0


def _app(state: FakeServer) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def generate(request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        state.requests.append(payload)
        chat = request.path.endswith("/chat/completions")
        if payload.get("fake_status"):
            return web.json_response({"error": {"message": "boom"}}, status=payload["fake_status"])
        state.in_flight += 1
        state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
        try:
            return await _stream(request, payload, chat)
        finally:
            state.in_flight -= 1

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


async def _stream(request: web.Request, payload: dict[str, Any], chat: bool) -> web.StreamResponse:
    text = answer_text(payload)
    pieces = [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]
    limit = payload.get("max_tokens") or payload.get("max_completion_tokens") or 16
    finish = "stop"
    if len(pieces) > limit:
        pieces, finish = pieces[:limit], "length"
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)

    async def send(obj: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(obj)}\n\n".encode())

    await asyncio.sleep(payload.get("fake_ttft", 0.0))
    if chat:
        await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    for i, piece in enumerate(pieces):
        if i:
            await asyncio.sleep(payload.get("fake_itl", 0.0))
        last = i == len(pieces) - 1
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish if last else None}
        if chat:
            choice["delta"] = {"content": piece}
        else:
            choice["text"] = piece
        await send({"choices": [choice]})
    include_usage = (payload.get("stream_options") or {}).get("include_usage")
    if include_usage and not payload.get("fake_no_usage"):
        usage = {"prompt_tokens": 3, "completion_tokens": len(pieces)}
        await send({"choices": [], "usage": usage})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    """A fake OpenAI-compatible server on 127.0.0.1 in a background thread."""
    state = FakeServer()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def start() -> None:
        runner = web.AppRunner(_app(state))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        state.url = f"http://127.0.0.1:{port}"
        holder["runner"] = runner
        ready.set()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    yield state
    asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    deadline = time.monotonic() + 30  # a hang check: the loop stops within a few ms
    while loop.is_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.close()
