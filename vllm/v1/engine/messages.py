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
    STATS = b"\x01"  # payload: EngineCoreStats
    ERROR = b"\x02"  # payload: EngineCoreError (the loop died; the process exits next)


class EngineCoreStats(msgspec.Struct, array_like=True):
    """A snapshot of the engine core's gauges and cumulative counters.

    The one stats schema: `Scheduler.make_stats` builds it, the engine core sends it as the
    STATS payload, and the API server keeps it as-is for /metrics (`PrometheusMetrics`).
    """

    # Requests in the running batch.
    num_running: int
    # Requests queued for a slot in the batch: new, preempted, or with a grammar compiling.
    num_waiting: int
    # Fraction of KV blocks owned by requests, in [0, 1].
    kv_cache_usage: float
    # Blocks no request owns (free, or cached prefix blocks that can be evicted).
    num_free_blocks: int
    # All KV blocks the engine allocated; fixed after startup.
    num_blocks: int
    # Preemptions since startup (cumulative).
    num_preemptions: int
    # Prompt tokens looked up in the prefix cache (cumulative).
    prefix_cache_queries: int
    # Prompt tokens found in the prefix cache (cumulative).
    prefix_cache_hits: int
    # Aborts that found the request still alive in the engine (cumulative).
    num_aborted_requests: int
    # Speculative decoding (cumulative): steps in which a request verified drafts, drafted
    # tokens, and drafted tokens kept. Acceptance rate = accepted / draft tokens; mean
    # accepted length = 1 + accepted / steps (each verification also samples one token).
    spec_decode_num_steps: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    # Structured-output compiles by backend and reason (cumulative): (backend, reason, count)
    # with reason "first_choice", or "fallback" when an earlier backend could not enforce
    # the constraint.
    grammar_backends: list[tuple[str, str, int]]
    # Wall-clock time of the snapshot (time.time()), in the engine-core process.
    timestamp: float
    # Grammar fast-forward (cumulative): drafted tokens the grammar forced (part of
    # spec_decode_num_draft_tokens), those kept (each a forward pass its request did not
    # need), and finished requests that kept at least one (forced tokens per fast-forwarded
    # request = kept / requests).
    fast_forward_forced_tokens: int = 0
    fast_forward_kept_tokens: int = 0
    fast_forward_requests: int = 0

    def same_as(self, other: EngineCoreStats | None) -> bool:
        """True when every field but the timestamp is equal (nothing new to send)."""
        if other is None:
            return False
        return msgspec.structs.replace(other, timestamp=self.timestamp) == self

    def of_dead_engine(self) -> EngineCoreStats:
        """This snapshot once its engine is gone: nothing runs or waits and its KV cache no
        longer exists (no blocks, no usage); the cumulative counters keep their values."""
        return msgspec.structs.replace(
            self, num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=0,
            num_blocks=0,
        )


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
