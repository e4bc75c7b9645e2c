"""The Ray actor that hosts one rank for RayExecutor (`--distributed-executor-backend ray`).

This module does not import ray: RayExecutor wraps `RayWorker` with `ray.remote` when it
starts, so the package imports without the optional `ray` extra.
"""

from __future__ import annotations

import os
import pickle
import socket
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.executor.worker_messages import invoke
from vllm.v1.outputs import AsyncModelRunnerOutput


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class RayWorker:
    """One rank: builds the Worker when told, then runs calls in the order they arrive (Ray
    runs a single caller's tasks on an actor in submission order)."""

    def __init__(self, rank: int, world_size: int, local_rank: int) -> None:
        self.rank = rank
        self.worker: Any = None
        os.environ["RANK"] = str(rank)
        os.environ["LOCAL_RANK"] = str(local_rank)
        os.environ["WORLD_SIZE"] = str(world_size)

    def address(self) -> tuple[str, int]:
        """This node's IP address and a TCP port free on it now (for torch.distributed's
        rendezvous when this is rank 0)."""
        ip = _node_ip()
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ip, sock.getsockname()[1]

    def start(self, vllm_config: VllmConfig, init_method: str) -> str:
        """Builds the Worker (joining the world over `init_method`) and loads the model; every
        rank must be started at the same time. Returns this node's IP address.

        Raises what loading raises (RayExecutor reports it with the rank).
        """
        from vllm.v1.worker.gpu_worker import Worker

        self.worker = Worker(vllm_config, self.rank, init_method)
        self.worker.load_model()
        return _node_ip()

    def call(self, payload: bytes, reply: bool) -> Any:
        """Runs one Worker call, `payload` being the pickled (method, args); returns its result
        when `reply` is set, else None (only the output rank answers steps, so the others
        send nothing back). An async model output is finished here: its host copy is what
        travels."""
        method, args = pickle.loads(payload)
        result = invoke(self.worker, method, args)
        if not reply:
            return None
        if isinstance(result, AsyncModelRunnerOutput):
            result = result.get_output()
        return result

    def ping(self) -> int:
        """Answers a health check: this actor's process id (an actor that died answers with
        Ray's RayActorError instead)."""
        return os.getpid()

    def close(self) -> None:
        """Leaves the distributed world. Idempotent."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
