"""The wire format between MultiprocExecutor and its worker processes.

A message is a ZMQ multipart message: one small pickled header frame, one pickled payload
frame, then the payload's large contiguous buffers (numpy arrays such as grammar bitmasks) as
extra frames, so they are never copied into the pickle stream.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

# Buffers smaller than this stay inside the pickle: an extra frame costs more than the copy.
_OUT_OF_BAND_MIN_BYTES = 1 << 16

# Response kinds (the third element of a response header).
READY = 0
OK = 1
ERROR = 2

# The call id of a worker's startup (READY, or ERROR when the worker cannot start).
STARTUP_CALL_ID = -1
# The method name that makes a worker's main loop return.
SHUTDOWN_METHOD = "__shutdown__"


@dataclass
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


def encode(payload: Any) -> list[bytes | memoryview]:
    """Pickles `payload` into frames: the pickle stream, then its large buffers.

    Raises pickle.PicklingError (or TypeError) when the payload cannot be pickled.
    """
    frames: list[bytes | memoryview] = [b""]

    def keep_in_band(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < _OUT_OF_BAND_MIN_BYTES:
            return True
        frames.append(raw)
        return False

    frames[0] = pickle.dumps(payload, protocol=5, buffer_callback=keep_in_band)
    return frames


def decode(frames: Sequence[zmq.Frame]) -> Any:
    """Inverse of `encode` for received frames. Arrays rebuilt from out-of-band buffers share
    (writable) memory with their frames, so no second copy is made."""
    return pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])


def send(sock: zmq.Socket, header: tuple, payload: Any, flags: int = 0) -> None:
    """Sends one message. The payload is encoded before anything is sent, so an unpicklable
    payload raises without sending a partial message.

    Frames are copied into ZMQ's buffers: the caller may reuse its arrays (the scheduler's
    bitmask buffers are recycled) as soon as this returns.
    """
    frames = encode(payload)
    sock.send_multipart([pickle.dumps(header, protocol=5), *frames], flags=flags, copy=True)


def recv(sock: zmq.Socket, flags: int = 0) -> tuple[tuple, list[zmq.Frame]]:
    """Receives one message: (header, payload frames for `decode`).

    Raises zmq.Again with zmq.NOBLOCK when nothing is waiting.
    """
    frames = sock.recv_multipart(flags=flags, copy=False)
    return pickle.loads(frames[0].buffer), frames[1:]
