"""The executor interface: how the engine core reaches its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.executor.worker_messages import WorkerMethod, as_method
from vllm.v1.outputs import ModelRunnerOutput


class Executor(ABC):
    """Runs model steps on one or more workers. With non_block=True a call returns a Future
    resolved in call order; otherwise it blocks and returns the result.

    A subclass implements `dispatch` (how one call reaches its workers), `check_health` and
    `shutdown`; the calls the engine makes are built on `dispatch` here. Its class
    attributes tell the configuration what it needs.
    """

    # The most ranks it can run (None: any number); a larger layout is a configuration error.
    max_world_size: ClassVar[int | None] = None
    # True when the ranks run on a cluster's devices, which the executor places itself: this
    # machine's device count and CUDA_VISIBLE_DEVICES then say nothing about them.
    remote_devices: ClassVar[bool] = False

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
        """The executor class named (or given) by --distributed-executor-backend. Raises
        ValueError naming the flag for a class that does not subclass Executor."""
        from vllm.v1.executor.registry import resolve  # it imports this module

        return resolve(vllm_config.parallel_config.distributed_executor_backend)

    @property
    def max_concurrent_batches(self) -> int:
        return self.vllm_config.max_concurrent_batches

    @abstractmethod
    def dispatch(
        self, method: WorkerMethod | Callable[..., Any], args: tuple, reply_all: bool
    ) -> Future:
        """Sends one call to every worker, behind every call before it; returns its Future.

        `method` is a WorkerMethod, or a function called as `method(worker, *args)`. The
        Future's result is every rank's result as a list by rank (`reply_all`), else the
        output rank's result. Raises RuntimeError when the workers are gone; the Future fails
        with what the call raised.
        """

    def collective_rpc(
        self,
        method: WorkerMethod | str | Callable[..., Any],
        args: tuple = (),
        non_block: bool = False,
        *,
        output_rank_only: bool = False,
        timeout: float | None = None,
    ) -> list[Any] | Any | Future:
        """Calls `method` on every worker: a WorkerMethod (or its name), or a function called
        as `method(worker, *args)` (picklable, and importable where the workers run, when
        they run elsewhere). Returns every rank's result as a list by rank, or only the
        output rank's with output_rank_only; with non_block, a Future of that.

        Raises UnknownWorkerMethodError for a name workers do not serve (before anything is
        sent), what the method raised, RuntimeError when a worker died, and TimeoutError
        after `timeout` seconds (blocking calls only).
        """
        future = self.dispatch(as_method(method), args, reply_all=not output_rank_only)
        return future if non_block else future.result(timeout)

    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold."""
        return min(self.collective_rpc(WorkerMethod.DETERMINE_NUM_BLOCKS))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates the KV cache on every worker."""
        self.collective_rpc(WorkerMethod.INITIALIZE_KV_CACHE, (num_blocks,))

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> None | Future:
        """Starts the forward pass of one step on every worker."""
        return self.collective_rpc(WorkerMethod.EXECUTE_MODEL, (scheduler_output,), non_block,
                                   output_rank_only=True)

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future:
        """Samples the oldest executed-but-unsampled step. The result (or the Future's result)
        is a ModelRunnerOutput, or an AsyncModelRunnerOutput whose get_output() waits for its
        device-to-host copy (see vllm.v1.engine.batch_queue.resolve_output); executors whose
        workers run elsewhere finish that copy before they answer."""
        return self.collective_rpc(WorkerMethod.SAMPLE_TOKENS, (grammar_output,), non_block,
                                   output_rank_only=True)

    @abstractmethod
    def check_health(self) -> None:
        """Raises RuntimeError if a worker has died (the engine core calls it while idle)."""

    def death_sentinels(self) -> list[int]:
        """File descriptors that turn readable when a worker dies, so the engine core can
        run check_health at once instead of at its next periodic check. Empty (the default)
        when the executor has none: the periodic check is then all there is."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the workers and frees their resources. Idempotent."""
