"""One worker inside the engine-core process, driven from a dedicated thread."""

from __future__ import annotations

import threading
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

    A sampling result is handed over (its Future resolved) once the forward queued behind it
    has started, or at once when none is queued. The engine thread's work on that result
    (update, outputs, the next schedule and bitmask) then runs beside the forward rather than
    beside the Python that prepares the forward's inputs: the two threads share one
    interpreter lock, and that preparation would otherwise wait out the engine's whole burst
    (docs/architecture.md §9).
    """

    max_world_size: ClassVar[int | None] = 1

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        # Imported here: naming this class (the executor registry) must not load the model code.
        from vllm.v1.worker.gpu_worker import Worker

        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-worker")
        self._lock = threading.Lock()
        # execute_model calls dispatched and not started yet.
        self._queued_forwards = 0
        # Sampling results done on the worker thread and not handed over yet, oldest first.
        self._held: list[tuple[Future, Any]] = []
        self.worker = Worker(vllm_config)
        self.worker.load_model()
        self.worker.model_runner.on_forward_start = self._hand_over

    def dispatch(
        self, method: WorkerMethod | Callable[..., Any], args: tuple, reply_all: bool
    ) -> Future:
        """Queues the call on the worker thread (see Executor.dispatch); the one worker is
        both every rank and the output rank."""
        if method is WorkerMethod.EXECUTE_MODEL:
            with self._lock:
                self._queued_forwards += 1
            return self._thread.submit(self._execute, args, reply_all)
        if method is WorkerMethod.SAMPLE_TOKENS:
            handed: Future = Future()
            queued = self._thread.submit(self._sample, handed, args, reply_all)
            # Shutdown cancels calls still queued: their callers must not wait forever.
            queued.add_done_callback(lambda call: call.cancelled() and handed.cancel())
            return handed
        return self._thread.submit(self._call, method, args, reply_all)

    def _call(self, method: WorkerMethod | Callable[..., Any], args: tuple,
              reply_all: bool) -> Any:
        result = invoke(self.worker, method, args)
        return [result] if reply_all else result

    def _execute(self, args: tuple, reply_all: bool) -> Any:
        with self._lock:
            self._queued_forwards -= 1
        try:
            return self._call(WorkerMethod.EXECUTE_MODEL, args, reply_all)
        finally:
            # A step without a forward (nothing scheduled, or a failure before it) hands
            # over here.
            self._hand_over()

    def _sample(self, handed: Future, args: tuple, reply_all: bool) -> None:
        """Samples on the worker thread; resolves `handed` now, or holds the result for
        `_hand_over` when a forward is queued behind this call."""
        if not handed.set_running_or_notify_cancel():
            return
        try:
            result = self._call(WorkerMethod.SAMPLE_TOKENS, args, reply_all)
        except BaseException as exc:
            self._hand_over()
            handed.set_exception(exc)
            return
        with self._lock:
            if self._queued_forwards:
                self._held.append((handed, result))
                return
        self._hand_over()
        handed.set_result(result)

    def _hand_over(self) -> None:
        """Resolves the held sampling results, oldest first (called on the worker thread when
        a forward starts or an execute_model call ends)."""
        with self._lock:
            held, self._held = self._held, []
        for handed, result in held:
            handed.set_result(result)

    def check_health(self) -> None:
        """Never raises: the worker lives as long as this process."""
        return None

    def shutdown(self) -> None:
        """Stops the worker thread after the call it is running; calls still queued are
        cancelled, and results still held are handed over. Idempotent."""
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._hand_over()
