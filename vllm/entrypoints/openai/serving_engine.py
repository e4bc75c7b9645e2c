"""What the completion and chat handlers share: request parsing, errors, sampling
parameters, structured-output options, logprob formatting and client-disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm.logprobs import Logprob
from vllm.entrypoints.openai.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    ErrorInfo,
    ErrorResponse,
    OpenAIBaseModel,
    PromptTokensDetails,
    SamplingRequestFields,
    UsageInfo,
    random_id,
)
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.exceptions import EngineDeadError, ErrorKind, InvalidRequestError, clean_message
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, OutputKind, RequestOutput
from vllm.sampling_params import NO_CONSTRAINT_MESSAGE, SamplingParams, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM, RequestStream

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=OpenAIBaseModel)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


def error_response(
    message: str, status: int = 400, param: str | None = None, err_type: str | None = None
) -> JSONResponse:
    """A JSON error in OpenAI's shape with the given HTTP status."""
    body = error_body(message, status, param, err_type)
    return JSONResponse(body.model_dump(), status_code=status)


def error_body(
    message: str, status: int = 400, param: str | None = None, err_type: str | None = None
) -> ErrorResponse:
    """The ErrorResponse model of an error; the message is reduced to one clean line (no
    traceback, no terminal escape codes), whatever raised it."""
    message = clean_message(message)
    if err_type is None:
        err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))


# The one table of what a failure means to an HTTP client: its status and OpenAI error type.
# A request that failed inside the engine arrives with an ErrorKind on its last output; an
# exception raised in this process is looked up by its kind (InvalidRequestError and its
# subclasses carry one) or else by its type, most specific class first. Nothing here reads
# an error's message.
ERROR_TABLE: dict[ErrorKind | type[BaseException], tuple[int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "BadRequestError"),
    ErrorKind.GRAMMAR: (400, "BadRequestError"),
    ErrorKind.CONFIG: (500, "InternalServerError"),
    ErrorKind.INTERNAL: (500, "InternalServerError"),
    EngineDeadError: (503, "ServiceUnavailableError"),
    # Untyped ValueErrors raised while preparing a request in this process (a tokenizer or
    # chat template rejecting its input) are still the request's fault.
    ValueError: (400, "BadRequestError"),
}


@dataclass(frozen=True)
class ServerError:
    """A failure as the client will see it: status, OpenAI error type, message, field."""

    status: int
    err_type: str
    message: str
    param: str | None = None

    def response(self) -> JSONResponse:
        """The JSON error response."""
        return error_response(self.message, self.status, self.param, self.err_type)

    def event(self) -> str:
        """The server-sent error event of a stream that already answered 200."""
        body = error_body(self.message, self.status, self.param, self.err_type)
        return sse(body.model_dump_json())


def classify(error: BaseException | ErrorKind) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of an exception or an engine error kind, from
    ERROR_TABLE; anything the table does not name is a 500."""
    key: ErrorKind | type[BaseException] | None = None
    if isinstance(error, ErrorKind):
        key = error
    elif isinstance(error, InvalidRequestError):
        key = error.kind
    else:
        key = next((cls for cls in type(error).__mro__ if cls in ERROR_TABLE), None)
    if key is None:
        return ERROR_TABLE[ErrorKind.INTERNAL]
    return ERROR_TABLE[key]


def exception_error(e: BaseException) -> ServerError:
    """The client's view of an exception raised while admitting or running a request."""
    status, err_type = classify(e)
    message = str(e) or type(e).__name__
    if isinstance(e, EngineDeadError):
        message = f"The engine is not available: {message}"
    param = e.param if isinstance(e, InvalidRequestError) else None
    return ServerError(status, err_type, message, param)


def output_error(output: CompletionOutput) -> ServerError:
    """The client's view of a sequence that ended with finish reason "error", by the kind
    the engine gave it (an output without one is treated as an engine bug)."""
    status, err_type = classify(output.error_kind or ErrorKind.INTERNAL)
    return ServerError(status, err_type, output.error or "the request failed in the engine")


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


class OpenAIServing:
    """Base of the completion and chat handlers.

    A subclass sets `id_prefix` and provides `_collect` (the final outputs of its streams),
    `_response` (the full JSON response) and `_stream` (the server-sent event chunks); `serve`
    runs one request through them.
    """

    id_prefix = "cmpl"

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ checks

    def check_model(self, request: SamplingRequestFields) -> str | JSONResponse:
        """The served name to report, or a 404 error for an unknown model."""
        name = self.models.resolve(request.model)
        if name is None:
            return error_response(
                f"The model `{request.model}` does not exist.", 404, param="model"
            )
        return name

    def engine_dead_response(self) -> JSONResponse | None:
        """503 when the engine process is gone, else None."""
        if self.engine.errored:
            return error_response(
                f"The engine is not available: {self.engine.dead_reason}", 503
            )
        return None

    # ------------------------------------------------------------------ parameters

    def sampling_params(
        self,
        request: SamplingRequestFields,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams of a request; `structured_outputs` replaces the request's own
        constraint (tool calling brings one). Raises ValueError naming the bad field."""
        if request.stream_options is not None and not request.stream:
            raise InvalidRequestError("stream_options", "only allowed when stream is true")
        if request.guided_whitespace_pattern is not None:
            raise InvalidRequestError("guided_whitespace_pattern", "is not supported")
        try:
            return self._build_sampling_params(request, max_tokens, logprobs, structured_outputs)
        except InvalidRequestError as e:
            # A chat request asks for a number of logprobs through top_logprobs (logprobs is
            # only its on/off switch), so that is the field a range error must name.
            if e.param == "logprobs" and getattr(request, "top_logprobs", None) is not None:
                raise InvalidRequestError("top_logprobs", e.message) from None
            raise

    def _given_or_default(self, request: SamplingRequestFields, name: str, fallback: Any) -> Any:
        """The request's value of a sampling field, else the model's generation-config
        default (--generation-config), else vLLM's."""
        value = getattr(request, name)
        if value is not None:
            return value
        return self.engine.model_config.sampling_defaults.get(name, fallback)

    def _build_sampling_params(
        self,
        request: SamplingRequestFields,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None,
    ) -> SamplingParams:
        """SamplingParams from the request's fields (raises what SamplingParams raises)."""
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and getattr(request, "echo", False) and logprobs is not None:
            prompt_logprobs = logprobs  # echo scores the prompt it echoes
        return SamplingParams(
            n=request.n,
            temperature=self._given_or_default(request, "temperature", 1.0),
            top_p=self._given_or_default(request, "top_p", 1.0),
            top_k=self._given_or_default(request, "top_k", 0),
            min_p=self._given_or_default(request, "min_p", 0.0),
            seed=request.seed,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=self._given_or_default(request, "repetition_penalty", 1.0),
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            structured_outputs=structured_outputs or structured_outputs_params(request),
            logit_bias=getattr(request, "logit_bias", None) or None,
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words,
            prompt_logprobs=prompt_logprobs,
        )

    # ------------------------------------------------------------------ running

    async def serve(
        self,
        request: SamplingRequestFields,
        raw_request: Request,
        prepare: Callable[[], tuple[list[Any], SamplingParams]],
    ) -> Response:
        """The HTTP response of one request (errors in OpenAI's shape).

        `prepare` gives the prompts and sampling parameters, raising ValueError (a 400) for bad
        input. A disconnecting client gets 499 and its engine requests are aborted.
        """
        model = self.check_model(request)
        if isinstance(model, JSONResponse):
            return model
        if (dead := self.engine_dead_response()) is not None:
            return dead
        try:
            # Rendering a chat template and building parameters is Python work proportional
            # to the request: off the event loop, so /health and other requests stay live.
            prompts, params = await asyncio.to_thread(prepare)
            request_id = request.request_id or random_id(self.id_prefix)
            # A non-streaming request reads only its final output: none is built before.
            kind = OutputKind.DELTA if request.stream else OutputKind.FINAL_ONLY
            lora = self.models.lora_request(model)
            streams = await self.add_requests(request_id, prompts, params, kind, lora)
        except (ValueError, EngineDeadError) as e:
            return exception_error(e).response()
        created = int(time.time())
        if request.stream:
            return StreamingResponse(
                sse_events(self._stream(request, streams, request_id, created, model)),
                media_type="text/event-stream",
            )
        try:
            finals = await cancel_on_disconnect(self._collect(streams), raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError as e:
            return exception_error(e).response()
        if (failed := finish_error(finals)) is not None:
            return failed.response()
        return json_response(self._response(request, finals, request_id, created, model))

    async def _collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of each stream, in stream order."""
        raise NotImplementedError

    def _response(
        self,
        request: Any,
        finals: list[RequestOutput],
        request_id: str,
        created: int,
        model: str,
    ) -> OpenAIBaseModel:
        """The full (non-streaming) response model of a finished request."""
        raise NotImplementedError

    def _stream(
        self,
        request: Any,
        streams: list[RequestStream],
        request_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[str]:
        """The server-sent event chunks of a streaming request, without the closing
        `[DONE]`; raises EngineDeadError if the engine dies."""
        raise NotImplementedError

    async def add_requests(
        self,
        request_id: str,
        prompts: list[Any],
        params: SamplingParams,
        kind: OutputKind,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """Admits one engine request per prompt (with the adapter of `lora_request`, if
        any). On any error, aborts the ones admitted and re-raises (ValueError: bad input;
        EngineDeadError: no engine)."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(
                    await self.engine.add_request(rid, prompt, params, kind, lora_request)
                )
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    # ------------------------------------------------------------------ logprobs

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """The text of one token as logprobs show it (special tokens included), or
        `token_id:<id>` with `as_id`."""
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = text
        return text

    def top_logprobs(self, entry: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
        """The k most likely tokens of one position, most likely first (logprobs finite)."""
        if k <= 0:
            return []
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
        return [(t, finite(lp.logprob)) for t, lp in ranked]


def prompt_logprobs_json(
    scores: list[dict[int, Logprob] | None] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """RequestOutput.prompt_logprobs in upstream's JSON shape (finite logprobs)."""
    if scores is None:
        return None
    return [
        None if entry is None else {
            str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                     "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in scores
    ]


def token_logprob(entry: dict[int, Logprob], token_id: int) -> float | None:
    """The logprob of `token_id` at one position (None when it is not listed)."""
    found = entry.get(token_id)
    return None if found is None else found.logprob


def finite(logprob: float | None) -> float | None:
    """A logprob JSON can carry: -inf (a masked token) becomes -9999.0, as OpenAI reports it."""
    if logprob is None:
        return None
    if logprob != logprob or logprob < -9999.0:
        return -9999.0
    return logprob


def usage_info(num_prompt: int, num_generated: int, num_cached: int) -> UsageInfo:
    """The usage block of a response (cached prompt tokens only when there are some)."""
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_generated,
        total_tokens=num_prompt + num_generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached) if num_cached else None,
    )


def sse(data: str) -> str:
    """One server-sent event carrying `data`."""
    return f"data: {data}\n\n"


async def sse_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """`chunks`, then `[DONE]`; an engine death while streaming becomes a 503 error event,
    and any other failure an error event of its kind (logged with its traceback), so the
    client always reads one clean error line and the end of the stream."""
    # Closing this stream (client gone) must close `chunks` at once, so that it aborts
    # its engine requests now rather than when garbage collected.
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        except EngineDeadError as e:
            yield exception_error(e).event()
        except Exception as e:
            # The response already answered 200: an error event is all that can still tell
            # the client, and without it the stream would just break off.
            logger.exception("a streaming response failed")
            yield exception_error(e).event()
    yield "data: [DONE]\n\n"


def json_response(model: Any, status: int = 200) -> Response:
    """A pydantic response model as a JSON response."""
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def structured_outputs_params(request: SamplingRequestFields) -> StructuredOutputsParams | None:
    """Gathers the one output constraint of a request from every surface that can give it:
    response_format, the extra-body structured_outputs object, and the guided_* fields.

    Raises ValueError when two are given or one is malformed.
    """
    found: list[tuple[str, str, Any]] = []  # (where, constraint, value)
    options: dict[str, Any] = {}
    rf = request.response_format
    if rf is not None:
        if rf.type == "json_schema":
            schema = rf.json_schema.json_schema if rf.json_schema is not None else None
            if schema is None:
                raise InvalidRequestError(
                    "response_format.json_schema",
                    "a JSON schema object ('schema') is required"
                )
            found.append(("response_format", "json", schema))
        elif rf.type == "json_object":
            found.append(("response_format", "json_object", True))
        elif rf.type == "structural_tag":
            found.append(("response_format", "structural_tag", rf.model_dump(exclude_none=True)))
    structured_outputs = request.structured_outputs
    if structured_outputs is not None:
        data = structured_outputs.model_dump(by_alias=True)
        for key in (
            "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
            "max_whitespace", "backend", "fast_forward",
        ):
            options[key] = data.pop(key)
        for key, value in data.items():
            if value is not None and value is not False:
                found.append(("structured_outputs", key, value))
        if not any(where == "structured_outputs" for where, _, _ in found):
            raise InvalidRequestError("structured_outputs", NO_CONSTRAINT_MESSAGE)
    for field, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(request, field)
        if value is not None:
            found.append((field, key, value))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(
            where if where.startswith("guided_") else f"{where}.{key}" for where, key, _ in found
        )
        raise InvalidRequestError(
            "structured_outputs",
            f"only one output constraint may be given, got {names}"
        )
    _, key, value = found[0]
    if request.guided_decoding_backend is not None:
        if options.get("backend") not in (None, request.guided_decoding_backend):
            raise InvalidRequestError(
                "guided_decoding_backend", "conflicts with structured_outputs.backend"
            )
        options["backend"] = request.guided_decoding_backend
    return StructuredOutputsParams(**{key: value}, **options)


async def cancel_on_disconnect(awaitable: Awaitable[T], raw_request: Request) -> T:
    """Awaits `awaitable`, cancelling it if the HTTP client disconnects first.

    Raises ClientDisconnected in that case (cancellation aborts the engine requests).
    """
    task = asyncio.ensure_future(awaitable)

    async def wait_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (stream index, output) from several streams as outputs arrive.

    Errors of any stream are raised here; leaving early aborts every stream.
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def finish_error(outputs: list[RequestOutput]) -> ServerError | None:
    """The error of the first sequence that ended with finish reason "error", else None."""
    for out in outputs:
        for c in out.outputs:
            if c.finish_reason == "error":
                return output_error(c)
    return None
