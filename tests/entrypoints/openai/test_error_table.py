"""The server's one error table: status and OpenAI error type by exception type or by the
engine's ErrorKind, and `param` from the exception's attribute, never from message text."""

from __future__ import annotations

import json
import pickle

import pytest

from vllm.entrypoints.openai.errors import classify, exception_error, finish_error, output_error
from vllm.exceptions import (
    EngineDeadError,
    ErrorKind,
    GrammarCompileError,
    InvalidRequestError,
    error_kind_of,
)
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.structured_output.compile_pool import CompileAbortedError


@pytest.mark.parametrize(
    ("error", "status", "err_type"),
    [
        (InvalidRequestError("max_tokens", "must be at least 1"), 400, "BadRequestError"),
        (GrammarCompileError("structured_outputs.json", "no value"), 400, "BadRequestError"),
        (CompileAbortedError("structured_outputs.regex", "too slow"), 400, "BadRequestError"),
        (ValueError("untyped, from a tokenizer"), 400, "BadRequestError"),
        (EngineDeadError("gone"), 503, "ServiceUnavailableError"),
        (RuntimeError("structured_outputs: looks like a client error"), 500,
         "InternalServerError"),
        (ErrorKind.INVALID_REQUEST, 400, "BadRequestError"),
        (ErrorKind.GRAMMAR, 400, "BadRequestError"),
        (ErrorKind.INTERNAL, 500, "InternalServerError"),
        (ErrorKind.CONFIG, 500, "InternalServerError"),
    ],
)
def test_table(error: BaseException | ErrorKind, status: int, err_type: str) -> None:
    assert classify(error) == (status, err_type)


def _failed(message: str, kind: ErrorKind | None) -> RequestOutput:
    seq = CompletionOutput(
        index=0, text="", token_ids=[], finish_reason="error", error=message, error_kind=kind
    )
    return RequestOutput("r", None, [1], [seq], finished=True)


@pytest.mark.parametrize(
    ("message", "kind", "status"),
    [
        # The old server chose by the message's first word; the kind decides now.
        ("structured_outputs.json: sampled token 7 was rejected", ErrorKind.INTERNAL, 500),
        ("sampled token 7 was rejected by the request's grammar", ErrorKind.INTERNAL, 500),
        ("compiling the grammar took longer than 1 s", ErrorKind.GRAMMAR, 400),
        ("structured_outputs.regex: does not compile", ErrorKind.GRAMMAR, 400),
        ("max_tokens: must be at least 1", ErrorKind.INVALID_REQUEST, 400),
        ("structured_outputs.json: no kind given", None, 500),
    ],
)
def test_engine_error_status_by_kind_not_text(
    message: str, kind: ErrorKind | None, status: int
) -> None:
    failed = finish_error([_failed(message, kind)])
    assert failed is not None
    assert (failed.status, failed.message) == (status, message)
    body = json.loads(failed.response().body)
    assert body["error"]["code"] == status and body["error"]["message"] == message
    event = json.loads(failed.event().removeprefix("data: "))
    assert event == body  # streaming reports through the same table


def test_finish_error_ignores_sequences_that_did_not_fail() -> None:
    ok = CompletionOutput(index=0, text="x", token_ids=[5], finish_reason="stop")
    assert finish_error([RequestOutput("r", None, [1], [ok], finished=True)]) is None


def test_param_comes_from_the_attribute() -> None:
    e = InvalidRequestError("messages[2].content", "only text parts are supported")
    assert str(e) == "messages[2].content: only text parts are supported"
    error = exception_error(e)
    assert (error.status, error.param, error.message) == (400, "messages[2].content", str(e))
    # A message that looks like it starts with another field does not change the param.
    error = exception_error(InvalidRequestError("n", "stop: looks like a field"))
    assert error.param == "n"
    # No field to blame: no param, and the text is the message alone.
    error = exception_error(InvalidRequestError(None, "Invalid JSON body: x"))
    assert (error.param, error.message) == (None, "Invalid JSON body: x")
    # An untyped error never gets a param guessed from its text.
    assert exception_error(ValueError("max_tokens: nope")).param is None


def test_engine_dead_is_503_with_its_reason() -> None:
    error = exception_error(EngineDeadError("killed by SIGKILL"))
    assert error.status == 503
    assert error.message == "The engine is not available: killed by SIGKILL"


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequestError("top_p", "must be in (0, 1]"),
        GrammarCompileError("structured_outputs.grammar", "rule 'a' can never finish"),
        CompileAbortedError("structured_outputs.json", "crashed its worker"),
    ],
)
def test_request_errors_keep_type_and_fields_across_processes(
    error: InvalidRequestError,
) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert (copy.param, copy.message, str(copy)) == (error.param, error.message, str(error))
    fresh = error.copy()
    assert type(fresh) is type(error) and fresh is not error and str(fresh) == str(error)


def test_error_kind_of() -> None:
    assert error_kind_of(InvalidRequestError("n", "x")) is ErrorKind.INVALID_REQUEST
    assert error_kind_of(GrammarCompileError("structured_outputs.json", "x")) is (
        ErrorKind.GRAMMAR
    )
    # A plain ValueError in the engine is code that should have raised a typed error.
    assert error_kind_of(ValueError("structured_outputs.json: x")) is ErrorKind.INTERNAL


def test_error_kind_crosses_the_engine_core_boundary() -> None:
    import msgspec

    out = EngineCoreOutput(
        request_id="r", new_token_ids=[], finish_reason="error", error="x",
        error_kind=ErrorKind.GRAMMAR,
    )
    data = msgspec.msgpack.encode(EngineCoreOutputs(outputs=[out]))
    decoded = msgspec.msgpack.decode(data, type=EngineCoreOutputs).outputs[0]
    assert decoded.error_kind is ErrorKind.GRAMMAR
    plain = EngineCoreOutput(request_id="r", new_token_ids=[1])
    data = msgspec.msgpack.encode(EngineCoreOutputs(outputs=[plain]))
    assert msgspec.msgpack.decode(data, type=EngineCoreOutputs).outputs[0].error_kind is None


def test_output_error_without_message() -> None:
    seq = CompletionOutput(
        index=0, text="", token_ids=[], finish_reason="error", error_kind=ErrorKind.INTERNAL
    )
    assert output_error(seq).message == "the request failed in the engine"
