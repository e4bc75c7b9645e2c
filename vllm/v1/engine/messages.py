"""Messages between the engine-core process and its client, besides requests and outputs.

Every ZMQ message is two frames: a one-byte type tag, then a msgspec-msgpack payload.
"""

from __future__ import annotations

import enum

import msgspec

from vllm.exceptions import ErrorKind


class RequestType(bytes, enum.Enum):
    """Client -> engine core."""

    ADD = b"\x00"  # payload: EngineCoreRequest
    ABORT = b"\x01"  # payload: list[str] of engine-side request ids
    SHUTDOWN = b"\x02"  # payload: empty


class OutputType(bytes, enum.Enum):
    """Engine core -> client."""

    OUTPUTS = b"\x00"  # payload: EngineCoreOutputs
    STATS = b"\x01"  # payload: EngineCoreStats (vllm/v1/metrics/engine_stats.py)
    ERROR = b"\x02"  # payload: EngineCoreError (the loop died; the process exits next)


class EngineCoreError(msgspec.Struct):
    """Why the engine core stopped serving (its busy loop raised)."""

    message: str


class EngineCoreHandshake(msgspec.Struct):
    """Sent once over the startup pipe: ready (with facts about the engine) or the error."""

    ok: bool
    # Set when ok: KV blocks the engine allocated.
    num_blocks: int = 0
    # Set when not ok: what kind of failure (CONFIG: the configuration is invalid; INTERNAL:
    # anything else) and its message. The client raises by the kind, never by the text.
    error_kind: ErrorKind = ErrorKind.INTERNAL
    error: str = ""
