"""One worker inside the engine-core process, driven from a dedicated thread."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

from vllm.config import VllmConfig
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.worker_messages import WorkerMethod, invoke


class UniProcExecutor(Executor):
    """Runs the worker's calls in order on one thread, so a non-blocking forward really runs
    while the engine thread schedules and fills bitmasks (on CPU as well as on CUDA).

    sample_tokens may answer an AsyncModelRunnerOutput: its host copy is awaited by whoever
    resolves it, not on the worker thread, so the worker can start the next forward at once.
    """

    max_world_size: ClassVar[int | None] = 1

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        # Imported here: naming this class (the executor registry) must not load the model code.
        from vllm.v1.worker.gpu_worker import Worker

        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-worker")
        self.worker = Worker(vllm_config)
        self.worker.load_model()

    def dispatch(
        self, method: WorkerMethod | Callable[..., Any], args: tuple, reply_all: bool
    ) -> Future:
        """Queues the call on the worker thread (see Executor.dispatch); the one worker is
        both every rank and the output rank."""
        if reply_all:
            return self._thread.submit(lambda: [invoke(self.worker, method, args)])
        return self._thread.submit(invoke, self.worker, method, args)

    def check_health(self) -> None:
        """Never raises: the worker lives as long as this process."""
        return None

    def shutdown(self) -> None:
        """Stops the worker thread after the calls already queued. Idempotent."""
        self._thread.shutdown(wait=True, cancel_futures=True)
