"""Reading a request's body: its size limit, strict JSON decoding (no NaN, no lone
surrogates), and pydantic validation, off the event loop when the body is large."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse

from vllm.entrypoints.openai.errors import error_response, exception_error
from vllm.entrypoints.openai.protocol import DEFAULT_MAX_BODY_BYTES, OpenAIBaseModel
from vllm.exceptions import InvalidRequestError

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=OpenAIBaseModel)


class BodyTooLarge(Exception):
    """The request body exceeds the server's limit."""


async def read_body(raw_request: Request, max_bytes: int) -> bytes:
    """The request body; raises BodyTooLarge as soon as it is known to exceed `max_bytes`
    (from Content-Length, or while reading a chunked body), without reading the rest."""
    declared = raw_request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge()
    chunks: list[bytes] = []
    size = 0
    async for chunk in raw_request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a JSON number")
    return value


def _surrogate_path(value: Any, path: str = "body") -> str | None:
    """Where the first lone surrogate in parsed JSON is ("messages[0].content"), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = key if path == "body" else f"{path}.{key}"
            found = _surrogate_path(key, path) or _surrogate_path(item, sub)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _surrogate_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def decode_json_body(body: bytes) -> Any:
    """Parses a request body as strict JSON: UTF-8, finite numbers only (no NaN, Infinity or
    1e999), no lone surrogates, bounded nesting. Raises ValueError naming the problem."""
    try:
        data = json.loads(body, parse_constant=_reject_constant, parse_float=_parse_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(None, f"Invalid JSON body: {e}") from None
    except RecursionError:
        raise InvalidRequestError(None, "Invalid JSON body: nested too deeply") from None
    except ValueError as e:
        raise InvalidRequestError(None, f"Invalid JSON body: {e}") from None
    # A cheap whole-body check first; the walk that finds the field runs only on failure.
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        where = _surrogate_path(data)
        raise InvalidRequestError(
            where,
            "contains a lone UTF-16 surrogate (not valid Unicode)"
        ) from None
    except RecursionError:
        raise InvalidRequestError(None, "Invalid JSON body: nested too deeply") from None
    return data


# Bodies up to this size decode and validate in well under a millisecond, less than a hop to
# a worker thread costs, so they stay on the event loop. A larger one (up to
# --max-request-body-bytes, 16 MiB by default: a quarter of a second or more) is parsed in a
# thread, so /health, other requests and running streams are not held while it parses.
OFF_LOOP_PARSE_BYTES = 64 << 10

R = TypeVar("R")


async def off_loop_if_large(size: int, fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)`: in a worker thread when `size` (the bytes it works through) exceeds
    OFF_LOOP_PARSE_BYTES, else right here on the event loop."""
    if size > OFF_LOOP_PARSE_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _too_large(max_bytes: int) -> JSONResponse:
    return error_response(
        f"Request body too large: the limit is {max_bytes} bytes (--max-request-body-bytes)",
        413,
    )


async def read_json_body(raw_request: Request, max_bytes: int) -> Any | JSONResponse:
    """The request body decoded as strict JSON (decode_json_body; off the event loop when
    large), or the 413 of a body over `max_bytes` or the 400 of one that is not JSON."""
    try:
        body = await read_body(raw_request, max_bytes)
    except BodyTooLarge:
        return _too_large(max_bytes)
    try:
        return await off_loop_if_large(len(body), decode_json_body, body)
    except ValueError as e:
        return exception_error(e).response()


async def parse_request(
    raw_request: Request,
    model_cls: type[T] | Callable[[dict[str, Any]], type[T]],
    max_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_messages: int | None = None,
) -> T | JSONResponse:
    """Reads and validates a JSON body; returns the model, a 400 for a malformed body or
    invalid fields (or more than `max_messages` chat messages), or a 413 for a body over
    `max_bytes`. `model_cls` is the request model, or a function choosing it from the
    decoded body (for an endpoint with two request shapes). A large body is decoded and
    validated off the event loop (OFF_LOOP_PARSE_BYTES)."""
    try:
        body = await read_body(raw_request, max_bytes)
    except BodyTooLarge:
        return _too_large(max_bytes)
    # Validating is linear in the body too (a million token ids take longer than decoding
    # them), so it goes with the decode.
    return await off_loop_if_large(len(body), _parse_body, body, model_cls, max_messages)


def _parse_body(
    body: bytes,
    model_cls: type[T] | Callable[[dict[str, Any]], type[T]],
    max_messages: int | None,
) -> T | JSONResponse:
    try:
        data = decode_json_body(body)
    except ValueError as e:
        return exception_error(e).response()
    if not isinstance(data, dict):
        return error_response("Invalid request body: expected a JSON object", 400)
    messages = data.get("messages")
    if max_messages is not None and isinstance(messages, list) and len(messages) > max_messages:
        # Checked before validation, which costs microseconds per message.
        return error_response(
            f"messages: {len(messages)} messages cannot fit in this model's context of "
            f"{max_messages} tokens", 400, param="messages"
        )
    if not isinstance(model_cls, type):
        model_cls = model_cls(data)
    try:
        return model_cls.model_validate(data)
    except pydantic.ValidationError as e:
        errors = e.errors(include_input=False, include_url=False)
        locs = [".".join(map(str, err.get("loc", ()))) for err in errors]
        parts = [f"{loc or 'body'}: {err['msg']}" for loc, err in zip(locs, errors)]
        return error_response("; ".join(parts[:5]), 400, param=locs[0] or None)
    except RecursionError:
        return error_response("Invalid request body: nested too deeply", 400)
