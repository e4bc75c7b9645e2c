"""What every API request passes before its handler: the API key check, the count of the
generation requests the server holds (from their first byte), and the request gate (the
shutdown and overload 503s, and parsing the body into its request model)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm.entrypoints.anthropic.errors import ANTHROPIC_PATHS
from vllm.entrypoints.anthropic.errors import error_response as anthropic_error_response
from vllm.entrypoints.openai.errors import error_response
from vllm.entrypoints.openai.protocol import OpenAIBaseModel
from vllm.entrypoints.openai.request_body import parse_request
from vllm.v1.engine.async_llm import AsyncLLM

T = TypeVar("T", bound=OpenAIBaseModel)


# The one route open without the API key: load balancers and orchestrators probe it, and it
# tells nothing but whether the engine serves.
OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Rejects every request without the API key (401), on every route but /health: the API,
    /metrics, /version and unknown paths alike (so a client without the key cannot even learn
    which routes exist). The key comes as `Authorization: Bearer <key>` (OpenAI's clients) or
    `x-api-key: <key>` (Anthropic's); the 401 of an Anthropic route is in Anthropic's shape."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._bearer = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        """Whether either header carries the key (compared in constant time)."""
        bearer = key = None
        for name, value in scope.get("headers", ()):
            # The first of each header counts, as for any repeated single-valued header.
            if name == b"authorization" and bearer is None:
                bearer = value
            elif name == b"x-api-key" and key is None:
                key = value
        # Both compared, so the time taken tells nothing about which header came close.
        by_bearer = hmac.compare_digest(bearer or b"", self._bearer)
        by_key = hmac.compare_digest(key or b"", self._key)
        return by_bearer or by_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Passes the request on when its path is open or it carries the key; else a 401."""
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] == "http" and path not in OPEN_PATHS and not self._authorized(scope):
            message = ("Unauthorized: a valid API key is required (Authorization: Bearer <key> "
                       "or x-api-key: <key>)")
            if path in ANTHROPIC_PATHS:
                response = anthropic_error_response(message, 401)
            else:
                response = error_response(message, 401)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# The routes that generate: the overload gate bounds these, and counts each from its first byte.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                              "/v1/messages"})


def route_path(scope: Scope) -> str:
    """The request's path without the --root-path prefix (behind it, /api/health is
    /health)."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class InFlightCounter:
    """Counts the generation requests the server holds, from the moment their headers arrive
    until their response has ended (or their client left), in `gate.in_flight`.

    The engine counts a request only once it is admitted (after its body is read, its
    constraint checked and its prompt tokenized), so under a burst every request would pass
    an overload check made against the engine's count while that count is still 0.
    """

    def __init__(self, app: ASGIApp, gate: RequestGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or route_path(scope) not in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        self.gate.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.in_flight -= 1


class RequestGate:
    """What every API request passes before its handler: the shutdown and overload checks
    (requests that generate only) and parsing the body into its request model."""

    def __init__(
        self, engine: AsyncLLM, max_body_bytes: int, max_waiting_requests: int | None
    ) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.max_waiting_requests = max_waiting_requests
        # Every message renders to at least one token, so more than the context cannot fit.
        self.max_messages = engine.model_config.max_model_len
        # Set by a graceful shutdown: new generation requests are refused from then on.
        self.draining = False
        # Generation requests the server holds, this one included (InFlightCounter).
        self.in_flight = 0

    def refusal(self) -> Response | None:
        """A 503 with Retry-After while the server shuts down or when the waiting requests
        reach --max-waiting-requests per engine; None when the request may proceed.

        Waiting counts every generation request the server holds beyond what the engines
        run at once, from its first byte: those still being read and checked as well as
        those queued in the engines."""
        if self.draining:
            return _retry_later("The server is shutting down; retry on another server")
        if self.max_waiting_requests is None:
            return None
        config = self.engine.vllm_config
        engines = config.parallel_config.data_parallel_size
        # Requests the engines run at once; admitted ones beyond it wait in their queues.
        capacity = config.scheduler_config.max_num_seqs * engines
        held = max(self.in_flight - 1, self.engine.num_unfinished_requests)
        waiting = held - capacity
        if waiting < self.max_waiting_requests * engines:
            return None
        return _retry_later(
            f"The server is overloaded: {waiting} requests are waiting "
            f"(--max-waiting-requests {self.max_waiting_requests}); retry later")

    async def handle(
        self,
        raw_request: Request,
        model_cls: type[T] | Callable[[dict[str, Any]], type[T]],
        handler: Callable[[T, Request], Awaitable[Response]],
        generates: bool = True,
    ) -> Response:
        """`handler`'s response to the parsed body, or the 400/413 of one that does not parse
        (or, for a request that generates, the 503 of an overloaded server, before the body is
        read)."""
        if generates and (refused := self.refusal()) is not None:
            return refused
        request = await parse_request(
            raw_request, model_cls, self.max_body_bytes, self.max_messages
        )
        if isinstance(request, Response):
            return request
        return await handler(request, raw_request)


def _retry_later(message: str) -> Response:
    response = error_response(message, 503)
    response.headers["Retry-After"] = "1"
    return response
