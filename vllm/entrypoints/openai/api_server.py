"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLM, run by uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from vllm import __version__
from vllm.entrypoints.anthropic.errors import ANTHROPIC_PATHS
from vllm.entrypoints.anthropic.errors import error_response as anthropic_error_response
from vllm.entrypoints.anthropic.routes import add_anthropic_routes
from vllm.entrypoints.openai.cli_args import warn_no_effect_flags
from vllm.entrypoints.openai.drain import DrainingServer
from vllm.entrypoints.openai.errors import error_response, exception_error
from vllm.entrypoints.openai.gate import (
    APIKeyMiddleware,
    InFlightCounter,
    RequestGate,
    route_path,
)
from vllm.entrypoints.openai.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
)
from vllm.entrypoints.openai.protocol_responses import ResponsesRequest
from vllm.entrypoints.openai.request_body import read_json_body
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import json_response
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

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

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
    # --tool-call-strict: off, function or parameter (see entrypoints/openai/tools.py).
    tool_call_strict: str = "off"
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
    # --chat-template's text (read and checked at startup; None: the model's) and
    # --default-chat-template-kwargs, handed to the engine's input processor.
    chat_template: str | None = None
    default_chat_template_kwargs: dict[str, object] = field(default_factory=dict)


def build_app(
    engine: AsyncLLM,
    models: OpenAIServingModels,
    metrics: PrometheusMetrics | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    tool_call_parser: str | None = None,
    max_waiting_requests: int | None = None,
    allow_runtime_lora_updating: bool = False,
    tool_call_strict: str = "off",
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
    add_openai_routes(app, engine, models, gate, tool_call_parser, tool_call_strict)
    add_anthropic_routes(app, engine, models, gate, tool_call_parser, tool_call_strict)
    add_error_handlers(app)
    # Inside the key check: a request without the key is never counted.
    app.add_middleware(InFlightCounter, gate=gate)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


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
    tool_call_strict: str = "off",
) -> None:
    """POST /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, /detokenize."""
    completion = OpenAIServingCompletion(engine, models)
    chat = OpenAIServingChat(engine, models, tool_call_parser, tool_call_strict)
    tokenization = OpenAIServingTokenization(chat, models)
    responses = OpenAIServingResponses(engine, models, tool_call_parser, tool_call_strict)

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
    """Errors in OpenAI's shape (Anthropic's on its routes): route/method errors keep their
    status, anything else is a logged 500."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Route and method errors (404, 405) in the error shape of the API asked."""
        if route_path(request.scope) in ANTHROPIC_PATHS:
            return anthropic_error_response(str(exc.detail), exc.status_code)
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
    engine.processor.chat_template = options.chat_template
    engine.processor.default_chat_template_kwargs = dict(options.default_chat_template_kwargs)
    app = build_app(engine, models, metrics, options.api_key, options.max_request_body_bytes,
                    options.tool_call_parser, options.max_waiting_requests,
                    options.allow_runtime_lora_updating, options.tool_call_strict)
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


def _sigterm_to_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_serve(args: argparse.Namespace) -> int:
    """Runs `vllm serve`; returns 0 after a clean shutdown, non-zero when startup fails."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.chat_utils import load_chat_template, parse_template_kwargs

    if args.model_tag and args.model and args.model_tag != args.model:
        print(f"error: MODEL {args.model_tag!r} and --model {args.model!r} disagree",
              file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("error: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = args.model_tag or args.model
    try:
        chat_template = load_chat_template(args.chat_template)
        template_kwargs = parse_template_kwargs(args.default_chat_template_kwargs)
        config = engine_args.create_engine_config()
        models = _serving_models(config, args.lora_modules or [], args.lora_allowed_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    options = ServerOptions(
        args.host, args.port, args.api_key, args.uvicorn_log_level, args.max_request_body_bytes,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        tool_call_strict=args.tool_call_strict,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
        root_path=args.root_path, max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout=args.shutdown_timeout, send_timeout=args.send_timeout,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        chat_template=chat_template, default_chat_template_kwargs=template_kwargs,
    )
    if options.max_waiting_requests is not None and options.max_waiting_requests < 0:
        print("error: --max-waiting-requests: must be at least 0", file=sys.stderr)
        return 2
    if not options.shutdown_timeout >= 0:
        print("error: --shutdown-timeout: must be at least 0 seconds", file=sys.stderr)
        return 2
    if not options.send_timeout >= 0:
        print("error: --send-timeout: must be at least 0 seconds", file=sys.stderr)
        return 2
    if (options.ssl_keyfile is None) != (options.ssl_certfile is None):
        print("error: --ssl-keyfile and --ssl-certfile go together", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(options.host, options.port)
    except OSError as e:
        print(f"error: cannot listen on {options.host or '0.0.0.0'}:{options.port}: {e}",
              file=sys.stderr)
        return 1
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    warn_no_effect_flags(args)
    # SIGTERM shuts down like Ctrl-C: engine process stopped, nothing left behind.
    previous = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    try:
        return _serve(args, config, models, sock, options)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serving_models(config: VllmConfig, lora_modules: list[str],
                    lora_allowed_dirs: list[str]) -> OpenAIServingModels:
    """The served names: the model's, and each --lora-modules adapter (checked now, so a
    bad one stops the server before it starts); and where runtime loads may read adapters
    from. Raises ValueError naming the flag."""
    from vllm.entrypoints.openai.serving_models import (
        OpenAIServingModels,
        lora_allowed_roots,
        parse_lora_module,
    )
    from vllm.lora.validation import LoRAValidator
    from vllm.model_executor.model_loader.default_model import (
        DEFAULT_MODEL_ALIAS,
        DEFAULT_MODEL_ID,
    )

    model_config = config.model_config
    validator = LoRAValidator(config) if config.lora_config is not None else None
    names = [model_config.served_model_name]
    if model_config.model == DEFAULT_MODEL_ID and names[0] == DEFAULT_MODEL_ID:
        names.append(DEFAULT_MODEL_ALIAS)  # requests may say "smollm2"
    models = OpenAIServingModels(names, str(model_config.model_dir),
                                 model_config.max_model_len, validator)
    if lora_modules and validator is None:
        raise ValueError("--lora-modules: needs --enable-lora")
    if lora_allowed_dirs and validator is None:
        raise ValueError("--lora-allowed-dir: needs --enable-lora")
    modules = [parse_lora_module(text) for text in lora_modules]
    for module in modules:
        try:
            models.load_lora_adapter(module.name, module.path, module.base_model_name)
        except ValueError as e:
            raise ValueError(f"--lora-modules {module.name}: {e}") from None
    models.lora_allowed_roots = lora_allowed_roots([m.path for m in modules],
                                                   lora_allowed_dirs)
    return models


def _serve(
    args: argparse.Namespace,
    config: VllmConfig,
    models: OpenAIServingModels,
    sock: socket.socket,
    options: ServerOptions,
) -> int:
    model_config = config.model_config
    name = model_config.served_model_name
    try:
        metrics = PrometheusMetrics(name, model_config.max_model_len,
                                    config.parallel_config.data_parallel_size)
        engine = AsyncLLM(config, log_requests=not args.disable_log_requests, metrics=metrics)
    except (ValueError, RuntimeError) as e:
        sock.close()
        print(f"error: the engine failed to start: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sock.close()
        return 0
    host, port = sock.getsockname()[:2]
    print(
        f"vLLM API server listening on {'https' if options.ssl_certfile else 'http'}://"
        f"{host}:{port}{options.root_path} serving model '{name}' "
        f"({model_config.model_dir}, max_model_len {model_config.max_model_len}, "
        f"engine core pid {', '.join(map(str, engine.engine_core.pids))})",
        flush=True,
    )
    try:
        run_server(engine, models, metrics, sock, options)
    except KeyboardInterrupt:
        pass
    print("vLLM API server shut down", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m vllm.entrypoints.openai.api_server [--model M] [flags]`: the same server,
    flags, errors and exit statuses as `vllm serve M [flags]`.

    A malformed command line exits (SystemExit, status 2) with a one-line error.
    """
    from vllm.entrypoints.cli.arg_parser import prepare_argv
    from vllm.entrypoints.openai.cli_args import SERVE_DESCRIPTION, SERVE_EPILOG, add_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

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
