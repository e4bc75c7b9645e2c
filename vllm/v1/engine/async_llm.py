"""AsyncLLM: the asyncio front end of an engine core running in another process."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import EngineDeadError, InvalidRequestError
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, OutputKind, RequestOutput
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.transformers_utils.tokenizer import get_model_tokenizer
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.constraint_checker import ConstraintChecker
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.engine.data_parallel import DataParallelClient
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.processor import InputProcessor, child_requests
from vllm.v1.metrics.engine_stats import EngineCoreStats
from vllm.v1.metrics.prometheus import PrometheusMetrics
from vllm.v1.metrics.stats import RequestStateStats, effective_max_tokens

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]

logger = logging.getLogger(__name__)


class RequestStream:
    """The outputs of one request, as an async iterator of RequestOutputs.

    Outputs that pile up before the consumer takes them are merged (delta outputs are
    concatenated, cumulative ones replaced by the newest), so a slow consumer costs no memory.
    Iterating raises EngineDeadError if the engine dies first. Leaving the iteration early
    (break, cancellation, client gone) aborts the request in the engine.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, delta: bool,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.request_id = request_id
        self.delta = delta
        # The prompt as the engine runs it, known before its first output.
        self.prompt_token_ids: list[int] = prompt_token_ids or []
        self.finished = False
        self._engine = engine
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        """Queues an output (merging with one not yet taken)."""
        if self._pending is None:
            self._pending = output
        elif self.delta:
            _merge_delta(self._pending, output)
        else:
            self._pending = output
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Ends the stream with `error` (raised to the consumer after queued outputs)."""
        self._error = error
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            while self._pending is None:
                if self._error is not None:
                    self.finished = True
                    raise self._error
                if self.finished:
                    raise StopAsyncIteration
                await self._ready.wait()
                self._ready.clear()
        except asyncio.CancelledError:
            # Cancelled while waiting (the client went away): stop the work in the engine.
            self.abort()
            raise
        output, self._pending = self._pending, None
        if output.finished:
            self.finished = True
        return output

    def end(self) -> None:
        """Marks the stream as ending after what is queued (the request was aborted)."""
        self.finished = True
        self._ready.set()

    def abort(self) -> None:
        """Aborts the request in the engine unless it already finished. Never blocks."""
        if not self.finished:
            self.end()
            self._engine.abort_now(self.request_id)

    async def aclose(self) -> None:
        """Aborts the request unless it finished (for `contextlib.aclosing`)."""
        self.abort()


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
        old.error = c.error
        old.error_kind = c.error_kind
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens


@dataclasses.dataclass
class _Tracked:
    """What the front end keeps about one live request."""

    stream: RequestStream
    child_ids: list[str]
    stats: RequestStateStats


class AsyncLLM:
    """Validates and tokenizes requests here, runs them in an engine-core process, and
    streams detokenized outputs back.

    The constructor starts the engine process and blocks until it is ready; it raises
    ValueError or RuntimeError with the engine's message when that fails.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        log_requests: bool = False,
        metrics: PrometheusMetrics | None = None,
        startup_timeout_s: float | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.log_requests = log_requests
        self.metrics = metrics
        logger.info("%s", vllm_config.scheduling_mode())
        self.tokenizer = get_model_tokenizer(self.model_config)
        # Its own checker: compile checks run here, before the engine ever sees a request, in
        # worker processes (started on the first structured request) that are killed when a
        # compile runs past its time limit, so no constraint can hold them for long.
        self.constraint_checker = ConstraintChecker(vllm_config, self.tokenizer)
        self.processor = InputProcessor(vllm_config, self.tokenizer, self.constraint_checker)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._requests: dict[str, _Tracked] = {}
        self._child_to_parent: dict[str, str] = {}
        self._dead_reason: str | None = None
        self._shut_down = False
        self.last_stats: EngineCoreStats | None = None
        self.engine_core: EngineCoreClient | DataParallelClient
        if vllm_config.parallel_config.data_parallel_size > 1:
            self.engine_core = DataParallelClient(vllm_config, startup_timeout_s)
            num_blocks = [client.num_blocks for client in self.engine_core.clients]
            if metrics is not None:
                metrics.watch_engines(self.engine_core.engine_states)
        else:
            self.engine_core = EngineCoreClient(vllm_config, startup_timeout_s=startup_timeout_s)
            num_blocks = [self.engine_core.num_blocks]
        if metrics is not None:
            metrics.describe_cache(vllm_config.cache_config, num_blocks)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """Builds the config (ValueError naming the bad flag) and starts the engine."""
        return cls(engine_args.create_engine_config(), **kwargs)

    # ------------------------------------------------------------------ health

    @property
    def errored(self) -> bool:
        """True once the engine core is gone (every request fails from then on)."""
        return self._dead_reason is not None or self.engine_core.dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is gone, or None."""
        return self._dead_reason or self.engine_core.dead_reason

    @property
    def is_healthy(self) -> bool:
        """True while the engine core serves."""
        return not self._shut_down and not self.errored

    @property
    def dead_engines(self) -> dict[int, str]:
        """Data-parallel engines that are gone while others serve, with the reason."""
        if isinstance(self.engine_core, DataParallelClient):
            return {s.index: s.dead_reason for s in self.engine_core.engine_states()
                    if s.dead_reason is not None}
        return {}

    @property
    def num_unfinished_requests(self) -> int:
        """Requests admitted and not yet finished or aborted."""
        return len(self._requests)

    def start(self) -> None:
        """Starts listening to the engine in the running event loop (done by the first
        request otherwise), so that its death is noticed even while no request runs."""
        if not self._shut_down:
            self.engine_core.start(self._on_outputs, self._on_stats, self._on_dead)

    def _ensure_started(self) -> None:
        if self._shut_down:
            raise EngineDeadError("the engine is shut down")
        self.engine_core.start(self._on_outputs, self._on_stats, self._on_dead)
        if self.errored:
            raise EngineDeadError(self.dead_reason or "the engine core is gone")

    # ------------------------------------------------------------------ requests

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Validates, tokenizes and admits a request (run with `lora_request`'s adapter, if
        any, at `priority` under --scheduling-policy priority); returns the stream of its
        outputs.

        Raises ValueError (bad prompt, parameters or constraint; too long for the context;
        duplicate request id) before anything reaches the engine, and EngineDeadError when the
        engine is gone.
        """
        self._ensure_started()
        self._check_unused(request_id)
        arrival = time.monotonic()
        if params.structured_outputs is not None:
            await self._check_compiles(params.structured_outputs)
        # Tokenizing a long prompt takes a while: never on the event loop.
        text, core_request = await asyncio.to_thread(
            self.processor.process, request_id, prompt, params, arrival, lora_request, priority
        )
        # Checked again after the awaits: another request may have taken the id meanwhile.
        self._ensure_started()
        self._check_unused(request_id)
        return self._admit(text, core_request, params, output_kind, arrival)

    def _check_unused(self, request_id: str) -> None:
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")

    async def _check_compiles(self, structured_outputs: StructuredOutputsParams) -> None:
        """Checks the constraint off the event loop: limits first, then a compile in a worker
        process within the time limit (counted from when a worker takes it); the processor's
        own check is then a lookup. Raises ValueError when it fails, RuntimeError when the
        compile workers cannot run."""
        # The limit checks walk the whole constraint: not on the event loop either.
        future = await asyncio.to_thread(self.constraint_checker.check, structured_outputs)
        seconds = await asyncio.wrap_future(future)
        if self.metrics is not None:
            self.metrics.record_compile(structured_outputs.kind, seconds)

    def _admit(
        self,
        text: str | None,
        core_request: EngineCoreRequest,
        params: SamplingParams,
        output_kind: OutputKind,
        arrival: float,
    ) -> RequestStream:
        request_id = core_request.request_id
        stream = RequestStream(self, request_id, delta=output_kind is OutputKind.DELTA,
                               prompt_token_ids=core_request.prompt_token_ids)
        child_ids = self.output_processor.add_request(
            request_id, text, core_request.prompt_token_ids, params, kind=output_kind
        )
        stats = RequestStateStats(
            arrival, len(core_request.prompt_token_ids), num_seqs=params.n,
            max_tokens=effective_max_tokens(params, len(core_request.prompt_token_ids),
                                            self.model_config.max_model_len))
        self._requests[request_id] = _Tracked(stream, child_ids, stats)
        for child in child_ids:
            self._child_to_parent[child] = request_id
        try:
            self.engine_core.add_requests(list(child_requests(core_request, params, child_ids)))
        except BaseException as e:
            # Whatever failed, the id and its children must not stay registered (aborting a
            # child the engine never got is a no-op there).
            self._forget(request_id)
            self.output_processor.abort_request(request_id)
            self.engine_core.abort_requests(child_ids)
            if isinstance(e, (EngineDeadError, ValueError)) or not isinstance(e, Exception):
                raise
            raise InvalidRequestError("request", f"cannot be sent to the engine: {e}") from e
        if isinstance(self.engine_core, DataParallelClient):
            stats.engine_index = self.engine_core.engine_of(child_ids[0])
        if self.log_requests:
            logger.info(
                "Received request %s: %d prompt tokens, params=%s",
                request_id, len(core_request.prompt_token_ids), params,
            )
        self._update_gauge()
        return stream

    async def generate(
        self,
        prompt: str | list[int] | dict[str, Any],
        sampling_params: SamplingParams,
        request_id: str,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the request's outputs as they are produced (see OutputKind); the last has
        `finished` set.

        Raises ValueError on bad input and EngineDeadError if the engine dies. Closing or
        cancelling the generator before the end aborts the request in the engine.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, output_kind,
                                        priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        """Aborts a request (no-op when unknown or finished)."""
        self.abort_now(request_id)

    def abort_now(self, request_id: str) -> None:
        """Synchronous abort, safe in `finally` blocks of cancelled tasks. Never blocks."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return
        tracked.stream.end()
        engine_ids = self.output_processor.abort_request(request_id)
        self._forget(request_id, finish_reason="abort")
        self.engine_core.abort_requests(engine_ids)
        if self.log_requests:
            logger.info("Aborted request %s", request_id)

    def _forget(self, request_id: str, finish_reason: str | None = None) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        for child in tracked.child_ids:
            self._child_to_parent.pop(child, None)
        if finish_reason is not None and self.metrics is not None:
            self.metrics.record_finished(tracked.stats.finish(finish_reason, time.monotonic()))
        self._update_gauge()

    def _update_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.set_num_frontend_requests(len(self._requests))

    # ------------------------------------------------------------------ engine callbacks

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.monotonic()
        if self.metrics is not None:
            parents = self._child_to_parent
            self.metrics.record_outputs(
                [
                    (self._requests[parent].stats, out.first_scheduled_time,
                     len(out.new_token_ids))
                    for out in outputs.outputs
                    if (parent := parents.get(out.request_id)) is not None
                ],
                now,
                outputs.engine_index,
            )
        results, to_abort = self.output_processor.process_outputs(outputs.outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        for result in results:
            tracked = self._requests.get(result.request_id)
            if tracked is None:
                continue
            tracked.stream.put(result)
            if result.finished:
                reason = _request_finish_reason(result.outputs)
                self._forget(result.request_id, finish_reason=reason)

    def _on_stats(self, stats: EngineCoreStats) -> None:
        if self._dead_reason is not None:
            # A snapshot still queued when the engine died must not bring its gauges back.
            return
        self.last_stats = stats
        if self.metrics is not None:
            self.metrics.record_engine_stats(stats)

    def _on_dead(self, reason: str) -> None:
        self._dead_reason = reason
        if self.last_stats is not None:
            self.last_stats = self.last_stats.of_dead_engine()
        if self.metrics is not None:
            self.metrics.record_engine_dead()
        self._fail_all(EngineDeadError(reason), finish_reason="error")

    # ------------------------------------------------------------------ shutdown

    def fail_requests(self, reason: str) -> None:
        """Ends every request in flight: its stream raises EngineDeadError(reason) (a 503;
        a stream's error event) and the engine stops computing it. The engine keeps serving."""
        engine_ids = self._fail_all(EngineDeadError(reason), finish_reason="abort")
        if engine_ids and self._dead_reason is None:
            self.engine_core.abort_requests(engine_ids)

    def _fail_all(self, error: BaseException, finish_reason: str) -> list[str]:
        """Fails every tracked request's stream with `error`; returns their engine ids."""
        engine_ids: list[str] = []
        for request_id in list(self._requests):
            tracked = self._requests[request_id]
            engine_ids += self.output_processor.abort_request(request_id)
            self._forget(request_id, finish_reason=finish_reason)
            tracked.stream.fail(error)
        return engine_ids

    def shutdown(self) -> None:
        """Stops the engine process and fails requests still in flight. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        self._fail_all(EngineDeadError("the engine is shutting down"), finish_reason="abort")
        self.engine_core.shutdown()
        self.constraint_checker.shutdown()


def _request_finish_reason(outputs: list[CompletionOutput]) -> str:
    """The reason a whole request ended: error beats abort beats length beats stop."""
    reasons = {c.finish_reason for c in outputs}
    for reason in ("error", "abort", "length", "stop"):
        if reason in reasons:
            return reason
    return next(iter(reasons), None) or "stop"
