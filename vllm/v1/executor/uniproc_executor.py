"""One worker inside the engine-core process, driven from a dedicated thread."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.worker_messages import WorkerMethod, as_method, invoke
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.gpu_worker import Worker


class UniProcExecutor(Executor):
    """Runs the worker's calls in order on one thread, so a non-blocking forward really runs
    while the engine thread schedules and fills bitmasks (on CPU as well as on CUDA)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-worker")
        self.worker = Worker(vllm_config)
        self.worker.load_model()

    def collective_rpc(
        self,
        method: WorkerMethod | str | Callable[..., Any],
        args: tuple = (),
        non_block: bool = False,
    ) -> list[Any] | Future:
        """Calls `method` on the worker (see Executor.collective_rpc); the result is a
        one-element list. Raises UnknownWorkerMethodError for a name workers do not serve."""
        # Resolved here, so an unknown name fails the same way as with the mp executor.
        target = as_method(method)
        future = self._thread.submit(lambda: [invoke(self.worker, target, args)])
        return future if non_block else future.result()

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> None | Future:
        future = self._thread.submit(self.worker.execute_model, scheduler_output)
        return future if non_block else future.result()

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future:
        # An async output's host copy is awaited by whoever resolves it, not on the worker
        # thread, so the worker is free to start the next forward at once.
        future = self._thread.submit(self.worker.sample_tokens, grammar_output)
        return future if non_block else future.result()

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
