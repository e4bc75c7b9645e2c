"""The engine core: scheduler + executor, stepped by `step` or `step_with_batch_queue`."""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future

from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
from vllm.v1.engine.messages import EngineCoreStats
from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu_input_batch import check_request_inputs

logger = logging.getLogger(__name__)


def resolve_output(output: ModelRunnerOutput | AsyncModelRunnerOutput) -> ModelRunnerOutput:
    """Waits for an async output's host copy, if it is one."""
    if isinstance(output, AsyncModelRunnerOutput):
        return output.get_output()
    return output


class EngineCore:
    """Owns the scheduler and the executor; one call to a step function runs (part of) a step."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        executor_class: type[Executor] | None = None,
        tokenizer=None,
    ) -> None:
        self.config = vllm_config
        executor_class = executor_class or Executor.get_class(vllm_config)
        self.model_executor = executor_class(vllm_config)
        try:
            num_blocks = self.model_executor.determine_num_blocks()
            self.model_executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.model_executor.shutdown()
            raise
        # KV blocks allocated (the startup handshake reports it to the client).
        self.num_blocks = num_blocks
        cache = vllm_config.cache_config
        kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.structured_output_manager = StructuredOutputManager(vllm_config, tokenizer)
        scheduler_cls = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
        self.scheduler: Scheduler = scheduler_cls(vllm_config, kv, self.structured_output_manager)
        self.eos_token_ids = vllm_config.model_config.eos_token_ids
        self.vocab_size = vllm_config.model_config.vocab_size
        self.max_model_len = vllm_config.model_config.max_model_len
        # (scheduler output, execute future, sample future or None when deferred)
        self.batch_queue: deque[tuple[SchedulerOutput, Future, Future | None]] = deque()
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        self.step_fn = self.step if self.batch_queue_size == 1 else self.step_with_batch_queue

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        """Admits a request into the scheduler's waiting queue.

        Never raises for a bad request: one whose parameters do not build, whose inputs the
        runner could not hold, or whose id is already live ends at once with finish reason
        "error" and the message (delivered with the next step's outputs); with a live id the
        running request of that id ends too, since the two can no longer be told apart.
        Checking here, before any batch holds the request, is what keeps one request's bad
        values from failing a whole step, which would end the engine for every request.
        """
        request_id = request.request_id
        try:
            if isinstance(request, EngineCoreRequest):
                params = SamplingParams(**request.sampling_params)
                request = Request(
                    request.request_id, request.prompt_token_ids, params, request.arrival_time
                )
            request.sampling_params.update_from_model(self.eos_token_ids)
            check_request_inputs(
                request.prompt_token_ids,
                request.sampling_params,
                self.vocab_size,
                self.max_model_len,
            )
            self.scheduler.add_request(request)
        except Exception as e:
            self.reject_request(request_id, str(e) or type(e).__name__)

    def reject_request(self, request_id: str, message: str) -> None:
        """Ends a request (admitted or not) with finish reason "error" and `message`."""
        self.scheduler.finish_with_error(request_id, message)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Ends requests; their in-flight tokens are dropped when they arrive."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    # ------------------------------------------------------------------ steps

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """One synchronous step: schedule, forward (bitmask computed meanwhile), sample,
        update. Returns the outputs and whether the model ran."""
        if not self.scheduler.has_requests():
            return self.scheduler.take_pending_outputs(), False
        scheduler_output = self.scheduler.schedule()
        exec_future = self.model_executor.execute_model(scheduler_output, non_block=True)
        grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
        exec_future.result()
        output = resolve_output(self.model_executor.sample_tokens(grammar_output))
        outputs = self.scheduler.update_from_output(scheduler_output, output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def step_with_batch_queue(self) -> tuple[list[EngineCoreOutput] | None, bool]:
        """One call of the overlapped loop (docs/architecture.md §4).

        Schedules and launches a new batch when there is work and room in the queue; returns
        early (None) while the queue is not full and more could be scheduled; otherwise
        finishes the oldest batch, and only then computes the deferred batch's bitmask.
        """
        if not self.batch_queue and not self.scheduler.has_unfinished_requests():
            # Idle: a plain step still reports finished ids to the runner and pending outputs.
            return self.step()
        scheduled = False
        # A queued deferred batch must sample before any newer forward: the runner holds the
        # logits of one executed-but-unsampled step only.
        deferred_queued = any(sample is None for _, _, sample in self.batch_queue)
        if (
            self.scheduler.has_unfinished_requests()
            and len(self.batch_queue) < self.batch_queue_size
            and not deferred_queued
        ):
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens > 0:
                scheduled = True
                exec_future = self.model_executor.execute_model(scheduler_output, non_block=True)
                sample_future = None
                if not scheduler_output.pending_structured_output_tokens:
                    grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
                    sample_future = self.model_executor.sample_tokens(
                        grammar_output, non_block=True
                    )
                self.batch_queue.appendleft((scheduler_output, exec_future, sample_future))
                if (
                    len(self.batch_queue) < self.batch_queue_size
                    and sample_future is not None
                    and self.scheduler.has_unfinished_requests()
                ):
                    return None, True
            else:
                self.scheduler.unschedule(scheduler_output)
        if not self.batch_queue:
            return self.scheduler.take_pending_outputs() or None, scheduled

        scheduler_output, exec_future, sample_future = self.batch_queue.pop()
        deferred = None
        if sample_future is None:
            # The deferred batch itself, now that nothing older is in flight. The worker runs
            # calls in order, so sampling follows the forward without waiting on it here.
            sample_future = self.model_executor.sample_tokens(
                self.scheduler.get_grammar_bitmask(scheduler_output), non_block=True
            )
        elif self.batch_queue and self.batch_queue[-1][2] is None:
            deferred = self.batch_queue.pop()
        output = resolve_output(sample_future.result())
        exec_future.result()  # already done; re-raises a forward-pass error
        outputs = self.scheduler.update_from_output(scheduler_output, output)
        if deferred is not None:
            deferred_scheduler_output, d_exec, _ = deferred
            grammar_output = self.scheduler.get_grammar_bitmask(deferred_scheduler_output)
            d_sample = self.model_executor.sample_tokens(grammar_output, non_block=True)
            self.batch_queue.append((deferred_scheduler_output, d_exec, d_sample))
        return outputs, True

    def shutdown(self) -> None:
        """Stops the executor and the grammar compiler threads."""
        self.model_executor.shutdown()
        self.structured_output_manager.shutdown()

    def make_stats(self) -> EngineCoreStats:
        """The engine's current gauges and counters (the scheduler's record, unchanged)."""
        return self.scheduler.make_stats()
