"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLM, run by uvicorn."""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm import __version__
from vllm.entrypoints.openai.drain import DrainingServer
from vllm.entrypoints.openai.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIBaseModel,
)
from vllm.entrypoints.openai.protocol_responses import ResponsesRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import (
    error_response,
    exception_error,
    json_response,
    parse_request,
    read_json_body,
)
from vllm.entrypoints.openai.serving_models import (
    ALLOW_RUNTIME_LORA_UPDATING_ENV,
    OpenAIServingModels,
    runtime_lora_updating_allowed,
)
from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm.entrypoints.openai.serving_tokenization import (
    OpenAIServingTokenization,
    tokenize_request_class,
)
from vllm.entrypoints.openai.stalled_send import AbortableHTTPProtocol, StalledSendGuard
from vllm.exceptions import clean_message
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.prometheus import PrometheusMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=OpenAIBaseModel)

# Seconds uvicorn waits for open responses once the drain ended them (they only have an
# error event and [DONE] left to send).
GRACEFUL_SHUTDOWN_S = 5


@dataclass
class ServerOptions:
    """How the HTTP side of `vllm serve` runs."""

    host: str | None = None
    port: int = 8000
    api_key: str | None = None
    uvicorn_log_level: str = "info"
    # Larger request bodies get a 413 before they are read in full.
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Reads tool calls out of replies with tool_choice "auto" (--enable-auto-tool-choice
    # --tool-call-parser); None: "auto" is refused.
    tool_call_parser: str | None = None
    # TLS: serve HTTPS with this key and certificate (both or neither).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # CORS: origins allowed to call the API from a browser (empty: no CORS headers).
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # The path prefix a proxy serves the app under (ASGI root_path).
    root_path: str = ""
    # Overload: a new generation request gets a 503 with Retry-After when this many
    # admitted requests already wait beyond what the engines run at once (None: no bound).
    max_waiting_requests: int | None = None
    # Graceful shutdown: seconds the running requests may finish after SIGTERM/SIGINT.
    shutdown_timeout: float = 5.0
    # A response write that cannot complete for this long (the client stopped reading) ends
    # the response and aborts its requests (StalledSendGuard); 0: no bound.
    send_timeout: float = 60.0
    # /v1/load_lora_adapter and /v1/unload_lora_adapter exist (with --enable-lora) only with
    # this or VLLM_ALLOW_RUNTIME_LORA_UPDATING (--allow-runtime-lora-updating).
    allow_runtime_lora_updating: bool = False


# The one route open without the API key: load balancers and orchestrators probe it, and it
# tells nothing but whether the engine serves.
OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Rejects every request without `Authorization: Bearer <api key>` (401), on every route
    but /health: the API, /metrics, /version and unknown paths alike (so a client without the
    key cannot even learn which routes exist)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Passes the request on when its path is open or it carries the key; else a 401."""
        if scope["type"] == "http" and route_path(scope) not in OPEN_PATHS:
            given = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    given = value
                    break
            if not hmac.compare_digest(given, self._expected):
                response = error_response(
                    "Unauthorized: a valid API key is required (Authorization: Bearer <key>)",
                    401,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# The routes that generate: the overload gate bounds these, and counts each from its first byte.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


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


def build_app(
    engine: AsyncLLM,
    models: OpenAIServingModels,
    metrics: PrometheusMetrics | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    tool_call_parser: str | None = None,
    max_waiting_requests: int | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The FastAPI app serving `engine`. The app's lifespan shuts the engine down at exit.

    The adapter admin routes exist with LoRA on and `allow_runtime_lora_updating` or
    VLLM_ALLOW_RUNTIME_LORA_UPDATING set (read now, not at import).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="vLLM OpenAI-compatible API", version=__version__, lifespan=lifespan)
    gate = RequestGate(engine, max_body_bytes, max_waiting_requests)
    app.state.gate = gate
    add_status_routes(app, engine, models, metrics, gate)
    if models.lora_validator is not None and runtime_lora_updating_allowed(
            allow_runtime_lora_updating):
        add_lora_routes(app, models, max_body_bytes)
    add_openai_routes(app, engine, models, gate, tool_call_parser)
    add_error_handlers(app)
    # Inside the key check: a request without the key is never counted.
    app.add_middleware(InFlightCounter, gate=gate)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


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


def add_status_routes(
    app: FastAPI,
    engine: AsyncLLM,
    models: OpenAIServingModels,
    metrics: PrometheusMetrics | None,
    gate: RequestGate,
) -> None:
    """GET /health, /version, /metrics and /v1/models."""

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine serves (with the data-parallel engines that are gone, if
        any), 503 once it is gone or from the moment a graceful shutdown starts draining
        (so a load balancer stops sending requests that would get a 503)."""
        if gate.draining:
            return error_response("The server is draining before it shuts down", 503)
        if engine.is_healthy:
            dead = engine.dead_engines
            if dead:
                return JSONResponse({"status": "degraded", "dead_engines": {
                    str(index): clean_message(reason) for index, reason in dead.items()}})
            return Response(status_code=200)
        reason = engine.dead_reason or "the server is shutting down"
        return error_response(f"The engine is not available: {reason}", 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        """The server's version."""
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        """Prometheus metrics (engine gauges, token counters, latency histograms)."""
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> Response:
        """The served models."""
        return json_response(models.show_available_models())


def add_openai_routes(
    app: FastAPI,
    engine: AsyncLLM,
    models: OpenAIServingModels,
    gate: RequestGate,
    tool_call_parser: str | None,
) -> None:
    """POST /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, /detokenize."""
    completion = OpenAIServingCompletion(engine, models)
    chat = OpenAIServingChat(engine, models, tool_call_parser)
    tokenization = OpenAIServingTokenization(chat, models)
    responses = OpenAIServingResponses(engine, models, tool_call_parser)

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request) -> Response:
        """OpenAI completions (streaming with stream=true)."""
        return await gate.handle(raw_request, CompletionRequest, completion.create_completion)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        """OpenAI chat completions (streaming with stream=true)."""
        return await gate.handle(raw_request, ChatCompletionRequest,
                                 chat.create_chat_completion)

    @app.post("/v1/responses")
    async def create_response(raw_request: Request) -> Response:
        """OpenAI Responses (streaming with stream=true)."""
        return await gate.handle(raw_request, ResponsesRequest, responses.create_response)

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> Response:
        """Token ids of a prompt, or of chat messages rendered by the chat template."""
        return await gate.handle(raw_request, tokenize_request_class, tokenization.tokenize,
                                 generates=False)

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> Response:
        """The text of a list of token ids."""
        return await gate.handle(raw_request, DetokenizeRequest, tokenization.detokenize,
                                 generates=False)


def add_error_handlers(app: FastAPI) -> None:
    """Errors in OpenAI's shape: route/method errors keep their status, anything else is a
    logged 500."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        """Route and method errors (404, 405) in OpenAI's error shape."""
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        """Anything unexpected: a 500 in OpenAI's error shape, logged."""
        logger.exception("unhandled error")
        return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)


def add_lora_routes(app: FastAPI, models: OpenAIServingModels, max_body_bytes: int) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora and the
    runtime-updating switch); loads only from inside `models.lora_allowed_roots`."""
    # Said once at startup: these routes read the server's disk on a client's word.
    logger.warning(
        "Runtime LoRA adapter loading is on (--allow-runtime-lora-updating or %s): clients "
        "may load adapters from inside %s", ALLOW_RUNTIME_LORA_UPDATING_ENV,
        ", ".join(models.lora_allowed_roots)
        or "no directory yet (give --lora-modules or --lora-allowed-dir)",
    )

    async def body(raw_request: Request) -> dict | Response:
        # Read and decoded as every other body: bounded, strict, off the loop when large.
        data = await read_json_body(raw_request, max_body_bytes)
        if isinstance(data, Response):
            return data
        if not isinstance(data, dict) or not isinstance(data.get("lora_name"), str):
            return error_response("lora_name: required (a string)", 400, param="lora_name")
        return data

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw_request: Request) -> Response:
        """Serves the PEFT adapter at `lora_path` as model `lora_name`; 400 when the name is
        taken, the path lies outside the allowed directories or the adapter is unfit."""
        data = await body(raw_request)
        if isinstance(data, Response):
            return data
        path = data.get("lora_path")
        if not isinstance(path, str) or not path:
            return error_response("lora_path: required (a string)", 400, param="lora_path")
        base = data.get("base_model_name")
        if base is not None and not isinstance(base, str):
            return error_response("base_model_name: must be a string", 400,
                                  param="base_model_name")
        try:
            # Reads the adapter's files: off the event loop.
            await asyncio.to_thread(
                models.load_runtime_lora_adapter, data["lora_name"], path, base
            )
        except ValueError as e:
            return exception_error(e).response()
        return Response(f"Success: LoRA adapter '{data['lora_name']}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw_request: Request) -> Response:
        """Stops serving adapter `lora_name`; 404 when no adapter has that name."""
        data = await body(raw_request)
        if isinstance(data, Response):
            return data
        if models.unload_lora_adapter(data["lora_name"]) is None:
            return error_response(f"The LoRA adapter `{data['lora_name']}` does not exist.",
                                  404, param="lora_name")
        return Response(f"Success: LoRA adapter '{data['lora_name']}' removed successfully.")


def bind_socket(host: str | None, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one.

    Raises OSError (e.g. the port is in use) before anything expensive starts.
    """
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: ASGIApp, options: ServerOptions) -> uvicorn.Config:
    """How uvicorn runs `app` for `vllm serve`: log level, shutdown and keep-alive times,
    TLS, root path, and the HTTP protocol the slow-reader drop needs."""
    return uvicorn.Config(
        app,
        log_level=options.uvicorn_log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=5,
        ssl_keyfile=options.ssl_keyfile,
        ssl_certfile=options.ssl_certfile,
        root_path=options.root_path,
        # Lets StalledSendGuard drop a client that stopped reading without uvicorn logging
        # the unfinished response as an error.
        http=AbortableHTTPProtocol,
    )


async def serve_http(
    app: FastAPI, engine: AsyncLLM, sock: socket.socket, options: ServerOptions
) -> None:
    """Serves `app` on `sock` until SIGINT/SIGTERM, then drains (DrainingServer; the signal
    is re-raised after shutdown); HTTPS when `options` carries a key and certificate."""
    server = DrainingServer(uvicorn_config(app, options), engine, app.state.gate,
                            options.shutdown_timeout)
    await server.serve(sockets=[sock])


def run_server(engine: AsyncLLM, models: OpenAIServingModels, metrics: PrometheusMetrics,
               sock: socket.socket, options: ServerOptions) -> None:
    """Runs the HTTP server in this thread until a signal stops it; always shuts the engine down.

    KeyboardInterrupt (Ctrl-C, or SIGTERM as the CLI maps it) propagates after the cleanup.
    """
    app = build_app(engine, models, metrics, options.api_key, options.max_request_body_bytes,
                    options.tool_call_parser, options.max_waiting_requests,
                    options.allow_runtime_lora_updating)
    if options.send_timeout > 0:
        app.add_middleware(StalledSendGuard, timeout_s=options.send_timeout)
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=options.allowed_origins,
            allow_methods=options.allowed_methods, allow_headers=options.allowed_headers,
            allow_credentials=options.allow_credentials,
        )
    try:
        asyncio.run(serve_http(app, engine, sock, options))
    finally:
        engine.shutdown()
        sock.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m vllm.entrypoints.openai.api_server [--model M] [flags]`: the same server,
    flags, errors and exit statuses as `vllm serve M [flags]`.

    A malformed command line exits (SystemExit, status 2) with a one-line error.
    """
    import sys

    from vllm.entrypoints.cli.arg_parser import FlexibleArgumentParser, prepare_argv
    from vllm.entrypoints.cli.serve import (
        SERVE_DESCRIPTION,
        SERVE_EPILOG,
        add_serve_args,
        run_serve,
    )

    parser = FlexibleArgumentParser(
        prog="python -m vllm.entrypoints.openai.api_server",
        description=SERVE_DESCRIPTION + " Same as `vllm serve`.",
        epilog=SERVE_EPILOG,
    )
    add_serve_args(parser)
    try:
        args = parser.parse_args(prepare_argv(sys.argv[1:] if argv is None else argv))
    except ValueError as e:
        parser.error(str(e))
    return run_serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
