"""The fake executor of the engine tests: a FakeRunner behind the Executor interface.

Its calls run in issue order on one worker, as with UniProcExecutor: by default on a worker
thread (test_engine_core), or wherever a subclass's `submit` puts them (test_batch_queue runs
them lazily, when the engine waits). Every call is reported to `log`, which subclasses turn
into their own event records.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

from tests.v1.core.sched_utils import FakeRunner
from vllm.config import VllmConfig
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.worker_messages import WorkerMethod
from vllm.v1.outputs import ModelRunnerOutput


class FakeExecutor(Executor):
    """Runs execute_model / sample_tokens on a FakeRunner, in call order, on one worker.

    Like the real runner it keeps executed-but-unsampled steps first in, first out, and
    sample_tokens samples the oldest. It refuses, with AssertionError at the call (so the
    engine step fails at once), what the real runner cannot do: a forward that feeds a request
    whose previous step's sample_tokens is not issued yet (the runner would feed a stale token
    from the device), more executed-but-unsampled steps than the queue depth, and a
    sample_tokens without an executed step.

    Class attributes set the pipeline depth and the forward time; `before_exec` (run on the
    worker at the start of a forward) lets tests hold a forward.
    """

    depth: ClassVar[int | None] = None  # None: VllmConfig's max_concurrent_batches
    forward_s: ClassVar[float] = 0.0

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.num_blocks = vllm_config.cache_config.num_gpu_blocks_override
        self.runner = FakeRunner(vllm_config.cache_config.block_size)
        self.before_exec: Callable[[int], None] | None = None
        # Engine side, in issue order: executed steps whose sample_tokens is not issued yet.
        self.unsampled: deque[SchedulerOutput] = deque()
        # Worker side: executed steps not sampled yet (the runner's FIFO).
        self.runner_fifo: deque[SchedulerOutput] = deque()
        # Threads start on the first submit only, so a subclass that never uses it pays nothing.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fake-worker")

    @property
    def max_concurrent_batches(self) -> int:
        return self.depth or super().max_concurrent_batches

    def log(self, kind: str, step: int) -> None:
        """Reports one moment of a call: exec_submit / sample_submit on the engine thread,
        exec_start, exec_end, sample_start, sample_end on the worker. Records nothing here."""

    def submit(self, kind: str, step: int, fn: Callable[[], Any]) -> Future:
        """Queues `fn`, the worker side of an "exec" or "sample" call for `step`, behind every
        call before it; returns its Future."""
        return self._pool.submit(fn)

    def dispatch(
        self, method: WorkerMethod | Callable[..., Any], args: tuple, reply_all: bool
    ) -> Future:
        """Answers the two calls the engine makes at startup (KeyError for any other)."""
        results = {WorkerMethod.DETERMINE_NUM_BLOCKS: self.num_blocks,
                   WorkerMethod.INITIALIZE_KV_CACHE: None}
        future: Future = Future()
        result = results[method]
        future.set_result([result] if reply_all else result)
        return future

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> None | Future:
        step = scheduler_output.step_id
        self.log("exec_submit", step)
        scheduled = set(scheduler_output.num_scheduled_tokens)
        for pending in self.unsampled:
            stale = scheduled & set(pending.sampled_req_ids)
            assert not stale, (
                f"step {step} feeds {sorted(stale)}, whose token from step {pending.step_id} "
                "is not sampled yet")
        assert len(self.unsampled) < self.max_concurrent_batches, (
            f"step {step}: more unsampled steps than depth")
        self.unsampled.append(scheduler_output)
        future = self.submit("exec", step, lambda: self._execute(scheduler_output))
        return future if non_block else future.result()

    def _execute(self, scheduler_output: SchedulerOutput) -> None:
        step = scheduler_output.step_id
        self.log("exec_start", step)
        if self.before_exec is not None:
            self.before_exec(step)
        time.sleep(self.forward_s)
        self.runner.execute(scheduler_output)
        self.runner_fifo.append(scheduler_output)
        self.log("exec_end", step)

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future:
        assert self.unsampled, "sample_tokens without an executed step"
        scheduler_output = self.unsampled.popleft()
        step = scheduler_output.step_id
        self.log("sample_submit", step)
        future = self.submit("sample", step, lambda: self._sample(scheduler_output, grammar_output))
        return future if non_block else future.result()

    def _sample(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput:
        self.log("sample_start", scheduler_output.step_id)
        oldest = self.runner_fifo.popleft()
        assert oldest is scheduler_output, "the runner must sample its oldest step"
        out = self.runner.sample(oldest, grammar_output)
        self.log("sample_end", scheduler_output.step_id)
        return out

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

