"""The executor interface: how the engine core reaches its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.executor.worker_messages import WorkerMethod
from vllm.v1.outputs import ModelRunnerOutput


class Executor(ABC):
    """Runs model steps on one or more workers. With non_block=True a call returns a Future
    resolved in call order; otherwise it blocks and returns the result."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
        """The executor class named by --distributed-executor-backend."""
        backend = vllm_config.parallel_config.distributed_executor_backend
        if backend == "mp":
            from vllm.v1.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from vllm.v1.executor.ray_executor import RayExecutor

            return RayExecutor
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor

    @property
    def max_concurrent_batches(self) -> int:
        return self.vllm_config.max_concurrent_batches

    @abstractmethod
    def collective_rpc(
        self,
        method: WorkerMethod | str | Callable[..., Any],
        args: tuple = (),
        non_block: bool = False,
    ) -> list[Any] | Future:
        """Calls `method` on every worker: a WorkerMethod (or its name), or a function called
        as `method(worker, *args)`. Returns every rank's result, as a list by rank.

        Raises UnknownWorkerMethodError for a name workers do not serve.
        """

    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold."""
        return min(self.collective_rpc(WorkerMethod.DETERMINE_NUM_BLOCKS))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates the KV cache on every worker."""
        self.collective_rpc(WorkerMethod.INITIALIZE_KV_CACHE, (num_blocks,))

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> None | Future:
        """Starts the forward pass of one step."""

    @abstractmethod
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future:
        """Samples the oldest executed-but-unsampled step. The result (or the Future's result)
        is a ModelRunnerOutput, or an AsyncModelRunnerOutput whose get_output() waits for its
        device-to-host copy (see vllm.v1.engine.batch_queue.resolve_output)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raises RuntimeError if a worker has died."""

    def death_sentinels(self) -> list[int]:
        """File descriptors that turn readable when a worker dies, so the engine core can
        run check_health at once instead of at its next periodic check. Empty (the default)
        when the executor has none: the periodic check is then all there is."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the workers and frees their resources. Idempotent."""
