"""The typed messages between an executor and workers outside the engine process (mp worker
processes, Ray actors), and their wire format.

Engine -> worker (mp: each worker's RPC socket; Ray: an actor task's argument):
    Call(call_id, method, args, reply_all)  run a WorkerMethod (or a function) with args
    Shutdown()                              leave the serve loop; the worker process exits
Worker -> engine (mp: the shared response socket; Ray: the task's return value):
    Ready(rank, pid)                        the worker has loaded its model (once, at startup)
    Result(call_id, rank, value)            a call returned `value`
    Failure(call_id, rank, error)           a call raised (call_id None: the startup failed)

One message is one ZMQ multipart message (on Ray, the same frames as a list of bytes):
    frame 0   header: a msgpack array [MessageKind, routing fields...]; small and never pickled
    frame 1   payload: Call args, Result value or Failure error, pickle protocol 5 (absent for
              Shutdown and Ready)
    frames 2+ the payload's buffers of 64 KiB or more (grammar bitmasks, token arrays) out of
              band, so they are never copied into the pickle stream
The header is read before the payload, so a payload that does not unpickle is still answered
as a failure of its own call.
"""

from __future__ import annotations

import enum
import pickle
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec
import zmq

# Buffers smaller than this stay inside the pickle: an extra frame costs more than the copy.
_OUT_OF_BAND_MIN_BYTES = 1 << 16

# What encode returns: bytes, or views of the payload's own buffers (not copied).
Frame: TypeAlias = bytes | memoryview


class MessageKind(enum.Enum):
    """The first element of every header: which message the frames carry."""

    CALL = 0
    SHUTDOWN = 1
    READY = 2
    RESULT = 3
    FAILURE = 4


class WorkerMethod(enum.Enum):
    """The Worker methods the engine calls in worker processes. They travel as these numbers,
    never by name; the member's lower-case name is the Worker attribute that serves it."""

    DETERMINE_NUM_BLOCKS = 1
    INITIALIZE_KV_CACHE = 2
    EXECUTE_MODEL = 3
    SAMPLE_TOKENS = 4

    @classmethod
    def parse(cls, name: str) -> WorkerMethod:
        """The member for a Worker method name ("execute_model").

        Raises UnknownWorkerMethodError when workers serve no method of that name.
        """
        member = cls.__members__.get(name.upper()) if name.islower() else None
        if member is None:
            raise UnknownWorkerMethodError(name)
        return member

    def bind(self, worker: Any) -> Callable[..., Any]:
        """`worker`'s bound method for this member."""
        return getattr(worker, self.name.lower())


class UnknownWorkerMethodError(ValueError):
    """A call named a method that workers do not serve (a name that is not a WorkerMethod, or
    a method number this side does not know)."""

    def __init__(self, method: str | int) -> None:
        # The one argument keeps the error picklable, so it crosses back from a worker as is.
        super().__init__(method)
        self.method = method

    def __str__(self) -> str:
        served = ", ".join(m.name.lower() for m in WorkerMethod)
        return f"unknown worker method {self.method!r}; workers serve: {served}"


class MessageDecodeError(Exception):
    """Frames that do not decode as a message. `call_id` and `rank` are what the header told
    before decoding failed (None when not even that decoded), so the receiver can answer the
    call; `error` is the underlying exception (also the __cause__)."""

    def __init__(self, call_id: int | None, rank: int | None, error: BaseException) -> None:
        super().__init__(call_id, rank, error)
        self.call_id = call_id
        self.rank = rank
        self.error = error

    def __str__(self) -> str:
        what = "a message" if self.call_id is None else f"call {self.call_id}"
        return f"could not decode {what}: {type(self.error).__name__}: {self.error}"


@dataclass(frozen=True)
class RemoteError:
    """An exception raised in a worker, in a form that always unpickles in the engine."""

    # The original exception when it survives a pickle round trip, else None.
    exc: Exception | None
    # Qualified class name of the original exception.
    type_name: str
    # str() of the original exception.
    message: str
    # The formatted remote traceback.
    traceback: str

    @classmethod
    def capture(cls, exc: BaseException) -> RemoteError:
        """Records `exc` (called in the worker, inside the except block)."""
        text = "".join(traceback.format_exception(exc))
        kept: Exception | None = None
        if isinstance(exc, Exception):
            try:
                kept = pickle.loads(pickle.dumps(exc, protocol=5))
            except Exception:
                kept = None
        name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        return cls(kept, name, str(exc), text)

    def rebuild(self, where: str) -> Exception:
        """The exception to raise in the engine: the original type when possible, else
        RuntimeError; its __cause__ carries the remote traceback text and a note names `where`
        (e.g. "worker rank 0 (pid 123)")."""
        exc = self.exc if self.exc is not None else RuntimeError(f"{self.type_name}: {self.message}")
        exc.__cause__ = RemoteTraceback(self.traceback)
        exc.add_note(f"raised in {where}; its traceback is shown above")
        return exc


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the cause of a re-raised exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


# ---------------------------------------------------------------------------- messages
#
# msgspec Structs only as cheap immutable records (several times faster to build than frozen
# dataclasses): msgspec never encodes them whole, because the payload fields must be pickled.


class Call(msgspec.Struct, frozen=True):
    """Engine -> worker: run `method` with `args`. Every worker runs every call, in arrival
    order; only the output rank replies unless `reply_all`, and a failure always replies."""

    call_id: int
    # A Worker method, or a picklable function called as method(worker, *args) (tests and
    # benchmarks use these to look inside a worker).
    method: WorkerMethod | Callable[..., Any]
    args: tuple = ()
    reply_all: bool = True

    def __post_init__(self) -> None:
        # A name string here is the untyped protocol this module replaced: refuse it early.
        if not isinstance(self.method, WorkerMethod) and not callable(self.method):
            raise TypeError(
                f"Call.method: a WorkerMethod or a function, got {self.method!r} "
                "(WorkerMethod.parse turns a name into a member)"
            )
        if not isinstance(self.args, tuple):
            raise TypeError(f"Call.args: a tuple, got {type(self.args).__name__}")

    def run(self, worker: Any) -> Any:
        """Runs the call on `worker` and returns its result; raises what the method raises."""
        return invoke(worker, self.method, self.args)


class Shutdown(msgspec.Struct, frozen=True):
    """Engine -> worker: stop serving calls and exit."""


class Ready(msgspec.Struct, frozen=True):
    """Worker -> engine, once: the worker at `rank` (process `pid`) has loaded its model."""

    rank: int
    pid: int


class Result(msgspec.Struct, frozen=True):
    """Worker -> engine: call `call_id` returned `value` on `rank`."""

    call_id: int
    rank: int
    value: Any


class Failure(msgspec.Struct, frozen=True):
    """Worker -> engine: call `call_id` raised on `rank` (call_id None: the worker could not
    start, and exits next)."""

    call_id: int | None
    rank: int
    error: RemoteError


Message: TypeAlias = Call | Shutdown | Ready | Result | Failure


def as_method(method: WorkerMethod | str | Callable[..., Any]) -> WorkerMethod | Callable[..., Any]:
    """What a Call may carry for an executor's `method` argument: names become WorkerMethod
    members, members and functions pass through.

    Raises UnknownWorkerMethodError for a name workers do not serve.
    """
    if isinstance(method, str):
        return WorkerMethod.parse(method)
    return method


def invoke(worker: Any, method: WorkerMethod | Callable[..., Any], args: tuple) -> Any:
    """Runs `method` on `worker` with `args` (a function gets the worker first) and returns its
    result; raises what the method raises."""
    if isinstance(method, WorkerMethod):
        return method.bind(worker)(*args)
    return method(worker, *args)


# ---------------------------------------------------------------------------- wire format

# Enum member access and lookup by value cost 0.2-0.5 us each (several per message, against
# about 2 us for a whole small message), so the codec works on their values, taken from the
# enums here so that they cannot disagree.
_CALL, _SHUTDOWN, _READY, _RESULT, _FAILURE = (kind.value for kind in MessageKind)
_METHOD_OF: dict[int, WorkerMethod] = {method.value: method for method in WorkerMethod}


def encode(msg: Message) -> list[Frame]:
    """The frames of `msg` (see the module docstring). The payload is pickled before anything
    is returned, so an unpicklable one raises without a partial message.

    Raises pickle.PicklingError (or TypeError, AttributeError) when the payload cannot be
    pickled, and TypeError for an object that is not a message.
    """
    if isinstance(msg, Call):
        method = msg.method
        if isinstance(method, WorkerMethod):
            return _frames([_CALL, msg.call_id, method._value_, msg.reply_all], msg.args)
        # No method number: the function travels with the args.
        return _frames([_CALL, msg.call_id, None, msg.reply_all], (method, msg.args))
    if isinstance(msg, Result):
        return _frames([_RESULT, msg.call_id, msg.rank], msg.value)
    if isinstance(msg, Failure):
        return _frames([_FAILURE, msg.call_id, msg.rank], msg.error)
    if isinstance(msg, Ready):
        return [msgspec.msgpack.encode([_READY, msg.rank, msg.pid])]
    if isinstance(msg, Shutdown):
        return [msgspec.msgpack.encode([_SHUTDOWN])]
    raise TypeError(f"not a worker message: {msg!r}")


def decode(frames: Sequence[zmq.Frame | bytes | memoryview]) -> Message:
    """The message that `encode` made these frames from. Arrays rebuilt from out-of-band
    buffers share memory with their frames, so no second copy is made.

    Raises MessageDecodeError (with the call id and rank when the header gave them) when the
    frames are not a message: a bad header, a payload that does not unpickle, or a Call of a
    method number this side does not know (error: UnknownWorkerMethodError).
    """
    buffers = [f.buffer if isinstance(f, zmq.Frame) else f for f in frames]
    try:
        header = msgspec.msgpack.decode(buffers[0])
        kind = header[0]
        if kind == _CALL:
            _, call_id, number, reply_all = header
        elif kind == _RESULT or kind == _FAILURE:
            _, call_id, rank = header
        elif kind == _READY:
            _, rank, pid = header
            return Ready(rank, pid)
        elif kind == _SHUTDOWN and len(header) == 1:
            return Shutdown()
        else:
            raise ValueError(f"not a message header: {header!r}")
    except Exception as exc:
        # Not a header of this vocabulary (or of the wrong shape): nothing in it can be trusted.
        raise MessageDecodeError(None, None, exc) from exc
    if kind == _CALL:
        return _decode_call(call_id, number, reply_all, buffers)
    return _decode_reply(kind == _RESULT, call_id, rank, buffers)


def send(sock: zmq.Socket, msg: Message, flags: int = 0) -> None:
    """Sends `msg` as one multipart message. Raises what `encode` raises (nothing is sent
    then), and zmq.ZMQError (zmq.Again with zmq.NOBLOCK when it cannot be queued).

    Frames are copied into ZMQ's buffers: the caller may reuse its arrays (the scheduler's
    bitmask buffers are recycled) as soon as this returns.
    """
    sock.send_multipart(encode(msg), flags=flags, copy=True)


def recv(sock: zmq.Socket, flags: int = 0) -> Message:
    """Receives one message. Raises zmq.Again with zmq.NOBLOCK when nothing is waiting, and
    MessageDecodeError as `decode` does (the message is consumed either way)."""
    return decode(sock.recv_multipart(flags=flags, copy=False))


def _frames(header: list[Any], payload: Any) -> list[Frame]:
    frames: list[Frame] = [msgspec.msgpack.encode(header), b""]

    def keep_in_band(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < _OUT_OF_BAND_MIN_BYTES:
            return True
        frames.append(raw)
        return False

    frames[1] = pickle.dumps(payload, protocol=5, buffer_callback=keep_in_band)
    return frames


def _unpickle(buffers: list[Any]) -> Any:
    """The payload of a message's buffers (header first)."""
    return pickle.loads(buffers[1], buffers=buffers[2:])


def _decode_call(call_id: int, number: int | None, reply_all: bool, buffers: list[Any]) -> Call:
    try:
        # The method is checked before the payload is unpickled: an unknown one runs nothing.
        method = None
        if number is not None:
            method = _METHOD_OF.get(number)
            if method is None:
                raise UnknownWorkerMethodError(number)
        payload = _unpickle(buffers)
        if method is None:
            method, payload = payload
        return Call(call_id, method, payload, reply_all)
    except Exception as exc:
        raise MessageDecodeError(call_id, None, exc) from exc


def _decode_reply(
    is_result: bool, call_id: int | None, rank: int, buffers: list[Any]
) -> Result | Failure:
    try:
        payload = _unpickle(buffers)
        if is_result:
            return Result(call_id, rank, payload)
        if not isinstance(payload, RemoteError):
            raise TypeError(f"a Failure carries a RemoteError, got {type(payload).__name__}")
        return Failure(call_id, rank, payload)
    except Exception as exc:
        raise MessageDecodeError(call_id, rank, exc) from exc
