"""The engine core: scheduler + executor, stepped by `step` or `step_with_batch_queue`."""

from __future__ import annotations

import logging

from vllm.attention.kv_cache_dtype import kv_cache_torch_dtype
from vllm.config import VllmConfig
from vllm.exceptions import ErrorKind, error_kind_of
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
from vllm.v1.engine.batch_queue import BatchQueue, resolve_output
from vllm.v1.metrics.engine_stats import EngineCoreStats
from vllm.v1.engine.validation import check_engine_request
from vllm.v1.executor.abstract import Executor
from vllm.v1.request import Request, RequestStatus
from vllm.v1.spec_decode.proposer import build_proposer
from vllm.v1.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


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
            # The draft model (if any) takes its memory before the KV cache is sized from
            # what is left; a draft model that cannot serve this target fails here.
            proposer = build_proposer(vllm_config)
            num_blocks = self.model_executor.determine_num_blocks()
            self.model_executor.initialize_kv_cache(num_blocks)
            # KV blocks allocated (the startup handshake reports it to the client).
            self.num_blocks = num_blocks
            cache = vllm_config.cache_config
            logger.info(
                "KV cache: %d blocks of %d tokens, stored as %s (--kv-cache-dtype %s)",
                num_blocks, cache.block_size,
                kv_cache_torch_dtype(cache.cache_dtype, vllm_config.model_config.torch_dtype),
                cache.cache_dtype,
            )
            kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
            self.structured_output_manager = StructuredOutputManager(vllm_config, tokenizer)
            # Pipeline stages overlap steps even without --async-scheduling: a request
            # preempted while its token is in flight must wait for it, which only
            # AsyncScheduler tracks.
            overlapped = (
                vllm_config.scheduler_config.async_scheduling
                or vllm_config.parallel_config.pipeline_parallel_size > 1
            )
            scheduler_cls = AsyncScheduler if overlapped else Scheduler
            self.scheduler: Scheduler = scheduler_cls(
                vllm_config, kv, self.structured_output_manager, proposer)
        except BaseException:
            self.model_executor.shutdown()
            raise
        self.eos_token_ids = vllm_config.model_config.eos_token_ids
        self.vocab_size = vllm_config.model_config.vocab_size
        self.max_model_len = vllm_config.model_config.max_model_len
        self.lora_config = vllm_config.lora_config
        # The in-flight batches of the overlapped loop; its depth is the executor's
        # max_concurrent_batches (2 under async scheduling, one per pipeline stage).
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        self.batch_queue = BatchQueue(self.scheduler, self.model_executor, self.batch_queue_size)
        self.step_fn = self.step if self.batch_queue_size == 1 else self.step_with_batch_queue

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        """Admits a request into the scheduler's waiting queue.

        Never raises for a bad request: one that fails `check_engine_request` (inputs the
        runner could not hold), whose parameters are not a SamplingParams, or whose id is
        already live ends at once with finish reason "error" and the message (delivered
        with the next step's outputs); with a live id the running request of that id ends
        too, since the two can no longer be told apart.
        Checking here, before any batch holds the request, is what keeps one request's bad
        values from failing a whole step, which would end the engine for every request.
        """
        request_id = request.request_id
        try:
            params = request.sampling_params
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params is a {type(params).__name__}")
            params.update_from_model(self.eos_token_ids)
            check_engine_request(
                request.prompt_token_ids, params, request.lora_request, self.vocab_size,
                self.max_model_len, self.lora_config,
            )
            if isinstance(request, EngineCoreRequest):
                request = Request(
                    request.request_id, request.prompt_token_ids, params, request.arrival_time,
                    request.lora_request, request.priority, request.cache_salt,
                    request.mm_features,
                )
            self.scheduler.add_request(request)
        except Exception as e:
            # The kind comes from the exception's type: the typed request errors raised by
            # the checks above are the client's fault (400), anything else an engine bug.
            self.reject_request(request_id, str(e) or type(e).__name__, error_kind_of(e))

    def reject_request(
        self, request_id: str, message: str, kind: ErrorKind = ErrorKind.INTERNAL
    ) -> None:
        """Ends a request (admitted or not) with finish reason "error", `message` and the
        `kind` of failure."""
        self.scheduler.finish_with_error(request_id, message, kind)

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
        sample_future = self.model_executor.sample_tokens(grammar_output, non_block=True)
        self.scheduler.sampling_issued(scheduler_output)
        output = resolve_output(sample_future.result())
        outputs = self.scheduler.update_from_output(scheduler_output, output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def step_with_batch_queue(self) -> tuple[list[EngineCoreOutput] | None, bool]:
        """One call of the overlapped loop (docs/architecture.md §4; the rules are in
        vllm/v1/engine/batch_queue.py). Returns None as outputs when the call only launched a
        batch."""
        if not self.batch_queue and not self.scheduler.has_unfinished_requests():
            # Idle: a plain step still reports finished ids to the runner and pending outputs.
            return self.step()
        return self.batch_queue.step()

    def check_health(self) -> None:
        """Asks the executor whether every worker still lives; raises (RuntimeError naming
        the rank) when one does not."""
        self.model_executor.check_health()

    def worker_death_sentinels(self) -> list[int]:
        """File descriptors that turn readable when a worker dies (see
        Executor.death_sentinels); possibly empty."""
        return self.model_executor.death_sentinels()

    def shutdown(self) -> None:
        """Stops the executor and the grammar compiler threads."""
        self.model_executor.shutdown()
        self.structured_output_manager.shutdown()

    def make_stats(self) -> EngineCoreStats:
        """The engine's current gauges and counters (the scheduler's record, unchanged)."""
        return self.scheduler.make_stats()
