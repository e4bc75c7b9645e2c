"""Streaming requests to an OpenAI-compatible server, timed chunk by chunk (aiohttp + SSE)."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# A benchmark may queue thousands of requests behind --max-concurrency; never time out on that.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class RequestFuncInput:
    """What to send: prompt, limits, and extra body fields merged into the JSON payload."""

    prompt: str
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    extra_body: dict[str, Any] | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None


@dataclass
class RequestFuncOutput:
    """What came back, with client-side timings in seconds."""

    generated_text: str = ""
    success: bool = False
    # Send to last byte.
    latency: float = 0.0
    # Send to first non-empty text chunk.
    ttft: float = 0.0
    # Gaps between consecutive non-empty text chunks.
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    # From the server's usage report; None when it sent none.
    output_tokens: int | None = None
    finish_reason: str | None = None
    error: str = ""
    start_time: float = 0.0


RequestFunc = Callable[[RequestFuncInput, aiohttp.ClientSession], Awaitable[RequestFuncOutput]]


def completions_payload(inp: RequestFuncInput) -> dict[str, Any]:
    """The JSON body of a streaming /v1/completions request."""
    return _streaming_payload(inp, {"prompt": inp.prompt, "max_tokens": inp.output_len})


def chat_payload(inp: RequestFuncInput) -> dict[str, Any]:
    """The JSON body of a streaming /v1/chat/completions request (the prompt as one user turn)."""
    return _streaming_payload(
        inp,
        {
            "messages": [{"role": "user", "content": inp.prompt}],
            "max_completion_tokens": inp.output_len,
        },
    )


def _streaming_payload(inp: RequestFuncInput, fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` (the prompt and output length, as the endpoint names them) plus what every
    request sends: model, temperature, streaming with usage, ignore_eos, then the extra body."""
    payload: dict[str, Any] = {
        "model": inp.model,
        **fields,
        "temperature": inp.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(inp.extra_body or {})
    return payload


async def request_completions(
    inp: RequestFuncInput, session: aiohttp.ClientSession
) -> RequestFuncOutput:
    """Streams one completion. Never raises for server or network errors: they come back
    as `success=False` with `error` set."""
    return await _stream(inp, session, completions_payload(inp), _completion_text)


async def request_chat_completions(
    inp: RequestFuncInput, session: aiohttp.ClientSession
) -> RequestFuncOutput:
    """Streams one chat completion; errors come back as `success=False` like completions."""
    return await _stream(inp, session, chat_payload(inp), _chat_text)


def get_request_func(endpoint: str) -> RequestFunc:
    """The request function for an endpoint path: chat for .../chat/completions, else completions.

    Raises ValueError for a path that is neither.
    """
    path = endpoint.rstrip("/")
    if path.endswith("/chat/completions"):
        return request_chat_completions
    if path.endswith("/completions"):
        return request_completions
    raise ValueError(f"endpoint: {endpoint!r} is neither .../completions nor .../chat/completions")


def _completion_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or ""


def _chat_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta") or {}
    return delta.get("content") or ""


async def _stream(
    inp: RequestFuncInput,
    session: aiohttp.ClientSession,
    payload: dict[str, Any],
    text_of: Callable[[dict[str, Any]], str],
) -> RequestFuncOutput:
    headers = {"Content-Type": "application/json"}
    if inp.api_key:
        headers["Authorization"] = f"Bearer {inp.api_key}"
    out = RequestFuncOutput(prompt_len=inp.prompt_len)
    parts: list[str] = []
    start = time.perf_counter()
    out.start_time = start
    last = start
    try:
        async with session.post(inp.api_url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = await response.text()
                out.error = f"HTTP {response.status}: {body[:500]}"
                return out
            async for raw in response.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    out.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return out
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    out.output_tokens = int(usage["completion_tokens"])
                for choice in chunk.get("choices") or []:
                    text = text_of(choice)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                    if not text:
                        continue
                    now = time.perf_counter()
                    if not parts:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    parts.append(text)
        out.latency = time.perf_counter() - start
        out.generated_text = "".join(parts)
        out.success = True
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        # ValueError covers malformed JSON chunks; the run goes on and reports the failure.
        out.error = f"{type(exc).__name__}: {exc}"
        out.generated_text = "".join(parts)
    return out
