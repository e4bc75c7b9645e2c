"""Errors as Anthropic's API reports them: `{"type": "error", "error": {"type", "message"}}`
with the HTTP status the error type goes with, and the `error` event that ends a stream.

The request gate, the body reader and the chat path answer errors in OpenAI's shape; the
Anthropic routes pass every such answer through `anthropic_error` so that one status table
decides what an Anthropic client sees. This module imports nothing of the OpenAI layer (the
API key check in `openai/gate.py` uses it)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse, Response

from vllm.exceptions import clean_message

# The paths answered in Anthropic's shape, errors included (the key check's 401 too).
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

# HTTP status -> Anthropic error type. 503 (draining, --max-waiting-requests, no engine) is
# the server asking to be retried later: Anthropic's overloaded_error.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# Headers of an OpenAI-shaped error answer that describe its old body, not the new one.
_BODY_HEADERS = frozenset({"content-length", "content-type"})


def error_type(status: int) -> str:
    """The Anthropic error type of an HTTP status (other 4xx: invalid_request_error, other
    5xx: api_error)."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(message: str, status: int) -> dict[str, Any]:
    """The JSON error body; the message is reduced to one clean line."""
    return {"type": "error",
            "error": {"type": error_type(status), "message": clean_message(message)}}


def error_response(message: str, status: int) -> JSONResponse:
    """An error answer in Anthropic's shape with the given HTTP status."""
    return JSONResponse(error_body(message, status), status_code=status)


def error_event(message: str, status: int) -> str:
    """The server-sent `error` event that ends a stream which already answered 200."""
    return sse_event("error", error_body(message, status))


def sse_event(kind: str, body: dict[str, Any]) -> str:
    """One server-sent event as Anthropic frames them: `event: <type>` and its JSON data."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


def anthropic_error(response: Response) -> Response:
    """`response` unchanged when it is not an error; an OpenAI-shaped error answer
    (`{"error": {"message", ...}}`) rewritten in Anthropic's shape, keeping its status and
    headers such as Retry-After. A body-less error (a 499 for a client that left) stays."""
    if response.status_code < 400 or not isinstance(getattr(response, "body", None), bytes):
        return response
    try:
        body = json.loads(response.body)
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response
    if not isinstance(message, str):
        return response
    converted = error_response(message, response.status_code)
    for name, value in response.headers.items():
        if name.lower() not in _BODY_HEADERS:
            converted.headers[name] = value
    return converted
