"""The Ray actor that hosts one rank for RayExecutor (`--distributed-executor-backend ray`).

Calls and replies are the mp executor's typed messages (worker_messages), in their wire
format, so both executors run a rank the same way (worker_host).

This module does not import ray: RayExecutor wraps `RayWorker` with `ray.remote` when it
starts, so the package imports without the optional `ray` extra.
"""

from __future__ import annotations

import os
import socket
import threading

from vllm.config import VllmConfig
from vllm.v1.executor import worker_messages
from vllm.v1.executor.worker_host import WorkerHost
from vllm.v1.executor.worker_messages import Call, Frame, MessageDecodeError


def as_bytes(frames: list[Frame]) -> list[bytes]:
    """Frames as Ray can serialize them (out-of-band buffers become bytes)."""
    return [bytes(frame) for frame in frames]


class RayWorker:
    """One rank: builds the Worker when told, then answers calls in the order they arrive
    (Ray runs a single caller's tasks on an actor in submission order)."""

    def __init__(self, rank: int, world_size: int, local_rank: int, output_rank: int) -> None:
        self._host = WorkerHost(rank, world_size, local_rank, output_rank)
        self._closed = threading.Event()

    def address(self) -> tuple[str, int]:
        """This node's IP address and a TCP port free on it now (for torch.distributed's
        rendezvous when this is rank 0)."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def start(self, vllm_config: VllmConfig, init_method: str) -> list[bytes]:
        """Builds the Worker (joining the world over `init_method`) and loads the model; every
        rank must be started at the same time. Returns the frames of Ready, or of the
        startup Failure."""
        return as_bytes(self._host.encode(self._host.start(vllm_config, init_method)))

    def call(self, frames: list[bytes]) -> list[bytes] | None:
        """Answers the frames of one Call with those of its Result or Failure, or None when
        this rank need not reply (only the output rank answers steps). An async model output
        is finished here: its host copy is what travels."""
        try:
            msg = worker_messages.decode(frames)
        except MessageDecodeError as exc:
            return as_bytes(self._host.encode(self._host.reject(exc)))
        if not isinstance(msg, Call):
            raise TypeError(f"worker rank {self._host.rank}: not a call: {msg!r}")
        reply = self._host.answer(msg)
        return None if reply is None else as_bytes(self._host.encode(reply))

    def ping(self) -> int:
        """Answers a health check: this actor's process id (an actor that died answers with
        Ray's RayActorError instead)."""
        return os.getpid()

    def watch(self) -> None:
        """Returns once this rank is closed. The executor keeps one call of it pending on
        its own concurrency group (so calls still run one at a time): Ray fails that call
        the moment the actor dies, which tells the executor at once (RayExecutor
        .death_sentinels)."""
        self._closed.wait()

    def close(self) -> None:
        """Leaves the distributed world (and ends a pending `watch`). Idempotent."""
        self._closed.set()
        self._host.close()
