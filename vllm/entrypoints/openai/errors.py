"""Errors as the OpenAI-compatible API reports them: the JSON error body, the HTTP status and
error type each failure kind maps to, and the error a finished output carries."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

from fastapi.responses import JSONResponse

from vllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from vllm.exceptions import EngineDeadError, ErrorKind, InvalidRequestError, clean_message
from vllm.outputs import CompletionOutput, RequestOutput

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
        return f"data: {body.model_dump_json()}\n\n"


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


def finish_error(outputs: list[RequestOutput]) -> ServerError | None:
    """The error of the first sequence that ended with finish reason "error", else None."""
    for out in outputs:
        for c in out.outputs:
            if c.finish_reason == "error":
                return output_error(c)
    return None
