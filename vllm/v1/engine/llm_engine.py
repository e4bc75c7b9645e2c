"""The in-process engine behind the offline LLM: processors around an EngineCore, no IPC."""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm import thread_policy
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.outputs import OutputKind, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import get_model_tokenizer
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
from vllm.v1.engine.constraint_checker import ConstraintChecker
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.processor import InputProcessor, child_requests
from vllm.v1.metrics.prometheus import PrometheusMetrics
from vllm.v1.metrics.reader import Metric, get_metrics_snapshot
from vllm.v1.metrics.stats import RequestStateStats, effective_max_tokens


logger = logging.getLogger(__name__)


class LLMEngine:
    """Adds requests, steps the engine core, and returns finished/updated RequestOutputs."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        """Builds the engine in this process. Raises ValueError for --data-parallel-size
        above 1, which only `vllm serve` runs."""
        dp = vllm_config.parallel_config.data_parallel_size
        if dp > 1:
            raise ValueError(
                f"--data-parallel-size {dp}: the offline engine runs one engine core; "
                "serve with `vllm serve -dp N` for several"
            )
        # For an engine built directly; a no-op after LLM did it (before importing torch).
        thread_policy.configure_process()
        self.vllm_config = vllm_config
        logger.info("%s", vllm_config.scheduling_mode())
        self.tokenizer = get_model_tokenizer(vllm_config.model_config)
        self.engine_core = EngineCore(vllm_config, tokenizer=self.tokenizer)
        # Checks compile with the engine's own manager: the request's compile is a cache hit.
        checker = ConstraintChecker(
            vllm_config, grammars=self.engine_core.structured_output_manager
        )
        self.processor = InputProcessor(vllm_config, self.tokenizer, checker)
        self.output_processor = OutputProcessor(self.tokenizer)
        model_config = vllm_config.model_config
        # This engine's own registry: engines in one process never share metric state.
        self.metrics = PrometheusMetrics(
            model_config.served_model_name or str(model_config.model), model_config.max_model_len
        )
        self.metrics.describe_cache(vllm_config.cache_config, [self.engine_core.num_blocks])
        # Per live request: its timing stats; each engine (child) id -> its request id.
        self._stats: dict[str, RequestStateStats] = {}
        self._child_to_parent: dict[str, str] = {}
        self._children: dict[str, list[str]] = {}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams,
        priority: int = 0,
    ) -> None:
        """Validates and queues a request (`priority`: its place under --scheduling-policy
        priority, lower first). Raises ValueError on bad input; nothing is queued."""
        text, core_request = self.processor.process(request_id, prompt, params,
                                                    priority=priority)
        self.add_processed_request(text, core_request, params)

    def add_processed_request(
        self,
        text: str | None,
        core_request: EngineCoreRequest,
        params: SamplingParams,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        """Queues a request that InputProcessor.process already validated; `output_kind`
        says what step() reports for it."""
        request_id = core_request.request_id
        child_ids = self.output_processor.add_request(
            request_id, text, core_request.prompt_token_ids, params, output_kind
        )
        num_prompt = len(core_request.prompt_token_ids)
        self._stats[request_id] = RequestStateStats(
            time.monotonic(), num_prompt, num_seqs=params.n,
            max_tokens=effective_max_tokens(
                params, num_prompt, self.vllm_config.model_config.max_model_len),
        )
        self._children[request_id] = list(child_ids)
        for child in child_ids:
            self._child_to_parent[child] = request_id
        for child_request in child_requests(core_request, params, child_ids):
            self.engine_core.add_request(child_request)

    def abort_request(self, request_ids: list[str]) -> None:
        """Aborts requests by their user-facing ids."""
        engine_ids = [cid for rid in request_ids for cid in self.output_processor.abort_request(rid)]
        self.engine_core.abort_requests(engine_ids)
        for rid in request_ids:
            self._forget(rid, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns outputs of requests that changed."""
        outputs, executed = self.engine_core.step_fn()
        if not outputs:
            if not executed:
                time.sleep(0.001)  # e.g. every request waits for its grammar to compile
            return []
        self._record_outputs(outputs)
        results, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        for result in results:
            if result.finished:
                reasons = {c.finish_reason for c in result.outputs}
                reason = next((r for r in ("error", "abort", "length", "stop") if r in reasons),
                              "stop")
                self._forget(result.request_id, reason)
        return results

    def _record_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Feeds one step's outputs to the request timing stats and token metrics."""
        parents = self._child_to_parent
        self.metrics.record_outputs(
            [
                (self._stats[parent], out.first_scheduled_time, len(out.new_token_ids))
                for out in outputs
                if (parent := parents.get(out.request_id)) is not None
            ],
            time.monotonic(),
        )

    def _forget(self, request_id: str, finish_reason: str) -> None:
        """Records a request's end in the metrics and drops its tracking."""
        stats = self._stats.pop(request_id, None)
        if stats is None:
            return
        for child in self._children.pop(request_id, ()):
            self._child_to_parent.pop(child, None)
        self.metrics.record_finished(stats.finish(finish_reason, time.monotonic()))

    def get_metrics(self) -> list[Metric]:
        """This engine's metrics (the same names as `/metrics`) as reader objects, with the
        engine core's gauges and counters as of now."""
        self.metrics.record_engine_stats(self.engine_core.make_stats())
        self.metrics.set_num_frontend_requests(len(self._stats))
        return get_metrics_snapshot(self.metrics.registry)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
