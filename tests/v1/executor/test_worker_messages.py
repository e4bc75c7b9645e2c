"""The executor <-> worker messages: every message survives encode/decode, large buffers travel
out of band without a copy, worker errors come back as their own type, and an unknown method
is refused with UnknownWorkerMethodError."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq

from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.executor import worker_messages
from vllm.v1.executor.worker_messages import (
    Call,
    Failure,
    MessageDecodeError,
    MessageKind,
    Ready,
    RemoteError,
    RemoteTraceback,
    Result,
    Shutdown,
    UnknownWorkerMethodError,
    WorkerMethod,
    as_method,
    decode,
    encode,
)

# A Qwen3-sized vocabulary: the bitmask of 64 requests is about 1.2 MB, far above the
# out-of-band threshold (64 KiB).
_VOCAB_WORDS = (151_936 + 31) // 32


def _add(worker: object, a: int, b: int) -> int:
    return a + b


class _StageError(Exception):
    """A custom exception type, which must come back as itself."""

    def __init__(self, stage: int, detail: str) -> None:
        super().__init__(stage, detail)
        self.stage = stage
        self.detail = detail

    def __str__(self) -> str:
        return f"stage {self.stage}: {self.detail}"


class _Unpicklable(Exception):
    """An exception that cannot cross a process boundary as itself."""

    def __reduce__(self):
        raise TypeError("not picklable")


class _BreaksOnUnpickle:
    """A value that pickles but fails to unpickle (as a class missing on the other side)."""

    def __reduce__(self):
        return (_explode, ())


def _explode() -> None:
    raise ImportError("no such module on this side")


def _raise_stage_error() -> None:
    raise _StageError(2, "the pipeline broke")


def _failure_of(fn, call_id: int | None = 7) -> Failure:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - captured like a worker does
        return Failure(call_id, 1, RemoteError.capture(exc))
    raise AssertionError("fn did not raise")


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A connected (PUSH, PULL) pair, as between the executor and a worker."""
    ctx = zmq.Context(1)
    tx, rx = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    rx.bind("inproc://worker-messages")
    tx.connect("inproc://worker-messages")
    yield tx, rx
    tx.close(linger=0)
    rx.close(linger=0)
    ctx.term()


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "msg",
    [
        Call(0, WorkerMethod.DETERMINE_NUM_BLOCKS),
        Call(1, WorkerMethod.INITIALIZE_KV_CACHE, (128,), reply_all=True),
        Call(2, WorkerMethod.EXECUTE_MODEL, ({"step": 3},), reply_all=False),
        Call(3, _add, (2, 3), reply_all=False),
        Shutdown(),
        Ready(rank=1, pid=4242),
        Result(5, 0, [1, (2, "three"), {"four": 4.0}]),
        Result(6, 1, None),
    ],
    ids=lambda m: type(m).__name__,
)
def test_round_trip(msg: worker_messages.Message, pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    assert decode(encode(msg)) == msg
    tx, rx = pair
    worker_messages.send(tx, msg)
    assert worker_messages.recv(rx, zmq.NOBLOCK) == msg
    with pytest.raises(zmq.Again):
        worker_messages.recv(rx, zmq.NOBLOCK)


def test_a_decoded_call_runs_on_the_worker() -> None:
    class Worker:
        def initialize_kv_cache(self, num_blocks: int) -> int:
            return num_blocks * 2

    worker = Worker()
    assert decode(encode(Call(0, WorkerMethod.INITIALIZE_KV_CACHE, (21,)))).run(worker) == 42
    assert decode(encode(Call(1, _add, (40, 2)))).run(worker) == 42


def test_headers_are_small_and_name_no_method() -> None:
    frames = encode(Call(123_456, WorkerMethod.SAMPLE_TOKENS, (None,), reply_all=False))
    header = msgspec.msgpack.decode(frames[0])
    assert header == [MessageKind.CALL.value, 123_456, WorkerMethod.SAMPLE_TOKENS.value, False]
    assert len(frames[0]) <= 16
    assert b"sample_tokens" not in b"".join(bytes(f) for f in frames)
    assert encode(Shutdown()) == [msgspec.msgpack.encode([MessageKind.SHUTDOWN.value])]


def test_failure_round_trip_rebuilds_the_original_exception() -> None:
    failure = _failure_of(_raise_stage_error)
    got = decode(encode(failure))
    assert isinstance(got, Failure) and (got.call_id, got.rank) == (7, 1)
    assert got.error.type_name.endswith("_StageError")
    exc = got.error.rebuild("worker rank 1 (pid 99)")
    assert type(exc) is _StageError
    assert (exc.stage, exc.detail) == (2, "the pipeline broke")
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert "_raise_stage_error" in str(exc.__cause__)
    assert exc.__notes__ == ["raised in worker rank 1 (pid 99); its traceback is shown above"]


def test_startup_failure_and_unpicklable_exception() -> None:
    def fail() -> None:
        raise _Unpicklable("cannot travel")

    failure = _failure_of(fail, call_id=None)
    got = decode(encode(failure))
    assert isinstance(got, Failure) and got.call_id is None
    # The type cannot be rebuilt: a RuntimeError names it and keeps the traceback.
    exc = got.error.rebuild("worker rank 1 (pid 99) at startup")
    assert type(exc) is RuntimeError
    assert "_Unpicklable: cannot travel" in str(exc)
    assert "fail" in str(exc.__cause__)


# ---------------------------------------------------------------------------- buffers


def _bitmask(rows: int) -> GrammarOutput:
    rng = np.random.default_rng(rows)
    bitmask = rng.integers(-(2**31), 2**31, size=(rows, _VOCAB_WORDS), dtype=np.int32)
    return GrammarOutput([f"req-{i}" for i in range(rows)], bitmask)


def test_large_buffer_travels_out_of_band_without_a_copy(
    pair: tuple[zmq.Socket, zmq.Socket],
) -> None:
    grammar = _bitmask(64)
    bitmask = grammar.grammar_bitmask
    assert bitmask.nbytes > 1 << 20
    frames = encode(Call(9, WorkerMethod.SAMPLE_TOKENS, (grammar,), reply_all=False))
    # Header, a pickle stream that holds only the small parts, and the bitmask's own memory.
    assert len(frames) == 3
    assert len(frames[1]) < 1024
    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.int32), bitmask)

    tx, rx = pair
    worker_messages.send(tx, Call(9, WorkerMethod.SAMPLE_TOKENS, (grammar,), reply_all=False))
    received = rx.recv_multipart(copy=False)
    call = decode(received)
    got = call.args[0].grammar_bitmask
    assert call.method is WorkerMethod.SAMPLE_TOKENS
    assert call.args[0].structured_output_request_ids == grammar.structured_output_request_ids
    np.testing.assert_array_equal(got, bitmask)
    # The decoded array is a view of the received frame: no second copy.
    assert np.shares_memory(got, np.frombuffer(received[2].buffer, dtype=np.int32))


def test_small_buffer_stays_in_band() -> None:
    small = np.arange(100, dtype=np.int32)
    frames = encode(Result(1, 0, small))
    assert len(frames) == 2
    np.testing.assert_array_equal(decode(frames).value, small)


def test_send_copies_so_the_caller_may_reuse_its_buffer(
    pair: tuple[zmq.Socket, zmq.Socket],
) -> None:
    # The scheduler recycles its bitmask buffers as soon as the call is sent.
    grammar = _bitmask(4)
    want = grammar.grammar_bitmask.copy()
    tx, rx = pair
    worker_messages.send(tx, Result(3, 0, grammar))
    grammar.grammar_bitmask[:] = 0
    np.testing.assert_array_equal(worker_messages.recv(rx).value.grammar_bitmask, want)


# ---------------------------------------------------------------------------- refusals


def test_unknown_method_name_is_refused() -> None:
    assert WorkerMethod.parse("execute_model") is WorkerMethod.EXECUTE_MODEL
    assert as_method("sample_tokens") is WorkerMethod.SAMPLE_TOKENS
    assert as_method(_add) is _add
    for name in ("no_such_method", "EXECUTE_MODEL", "load_model", "__shutdown__", ""):
        with pytest.raises(UnknownWorkerMethodError) as info:
            as_method(name)
        assert info.value.method == name
        assert str(info.value) == (
            f"unknown worker method {name!r}; workers serve: determine_num_blocks, "
            "initialize_kv_cache, execute_model, sample_tokens"
        )
    # The error crosses back from a worker as itself.
    again = pickle.loads(pickle.dumps(UnknownWorkerMethodError("nope")))
    assert type(again) is UnknownWorkerMethodError and again.method == "nope"


def test_a_call_takes_no_method_name() -> None:
    with pytest.raises(TypeError, match="WorkerMethod or a function"):
        Call(0, "execute_model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Call.args: a tuple"):
        Call(0, WorkerMethod.EXECUTE_MODEL, [1])  # type: ignore[arg-type]


def test_unknown_method_number_is_refused_before_the_payload() -> None:
    # As from an engine that knows a method this worker does not: the header still names the
    # call, so the worker can answer it with the typed error; the payload is never unpickled.
    frames = encode(Call(17, _add, (_BreaksOnUnpickle(),), reply_all=False))
    frames[0] = msgspec.msgpack.encode([MessageKind.CALL.value, 17, 99, False])
    with pytest.raises(MessageDecodeError) as info:
        decode(frames)
    assert info.value.call_id == 17
    assert isinstance(info.value.error, UnknownWorkerMethodError)
    assert info.value.error.method == 99
    assert "unknown worker method 99" in str(info.value)


def test_undecodable_payload_names_its_call() -> None:
    with pytest.raises(MessageDecodeError) as info:
        decode(encode(Result(11, 1, _BreaksOnUnpickle())))
    assert (info.value.call_id, info.value.rank) == (11, 1)
    assert isinstance(info.value.error, ImportError)
    with pytest.raises(MessageDecodeError) as info:
        decode(encode(Call(12, WorkerMethod.EXECUTE_MODEL, (_BreaksOnUnpickle(),))))
    assert info.value.call_id == 12 and isinstance(info.value.error, ImportError)


@pytest.mark.parametrize(
    "header",
    [[42], [MessageKind.CALL.value, 1], [MessageKind.SHUTDOWN.value, 1], "call", []],
    ids=["unknown-kind", "short-call", "long-shutdown", "not-a-list", "empty"],
)
def test_bad_header_is_refused(header: object) -> None:
    with pytest.raises(MessageDecodeError) as info:
        decode([msgspec.msgpack.encode(header), pickle.dumps(())])
    assert info.value.call_id is None and info.value.rank is None


def test_failure_must_carry_a_remote_error() -> None:
    frames = encode(Result(4, 0, "not an error"))
    frames[0] = msgspec.msgpack.encode([MessageKind.FAILURE.value, 4, 0])
    with pytest.raises(MessageDecodeError, match="RemoteError") as info:
        decode(frames)
    assert (info.value.call_id, info.value.rank) == (4, 0)


def test_unpicklable_payload_raises_before_sending(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    tx, rx = pair
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        worker_messages.send(tx, Result(1, 0, lambda: None))
    with pytest.raises(TypeError, match="not a worker message"):
        encode(("call", 1))  # type: ignore[arg-type]
    with pytest.raises(zmq.Again):
        rx.recv_multipart(zmq.NOBLOCK)


def test_every_worker_method_is_served_by_the_worker() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    for method in WorkerMethod:
        assert callable(getattr(Worker, method.name.lower(), None)), method
