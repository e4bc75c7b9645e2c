"""Prometheus metrics of one server or offline engine: the request-level counters and
histograms the front end records, beside the engine collector (engine_collector.py).

Names, types and labels follow upstream vLLM V1's (docs/architecture.md section 4): each
request metric is labelled with `model_name` and the `engine` (data-parallel rank) that
served the request.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from vllm.v1.metrics.engine_collector import ENGINE_LABELS, EngineCollector, cache_config_labels
from vllm.v1.metrics.engine_stats import EngineCoreStats
from vllm.v1.metrics.stats import FinishedRequestStats, RequestStateStats

if TYPE_CHECKING:
    from vllm.v1.engine.data_parallel import EngineState

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0,
)
_TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0,
)
# Upstream's request-phase buckets (seconds), so dashboards built for vLLM read the same.
_PHASE_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
# Tokens one engine step processed (prompt tokens of prefills it finished + new tokens).
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
# The finish reasons every engine's request_success_total shows from the start (at 0).
_FINISH_REASONS = ("stop", "length", "abort", "error")
_COMPILE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (the buckets of token-count histograms)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def observe_many(histogram: Any, value: float, count: int) -> None:
    """What `count` calls of `histogram.observe(value)` record, in one update of its sum and
    of the one bucket `value` falls in (histogram: a labelled prometheus_client Histogram).

    prometheus_client has no counted observe, so this reads its Histogram's fields
    (`_upper_bounds`, `_buckets` holding per-bucket counts, `_sum`); the tests compare it with
    repeated observe calls, so a release that changes them fails there. The sum may differ
    from `count` separate additions in the last bits of its float.
    """
    if count == 1:
        histogram.observe(value)
        return
    histogram._sum.inc(value * count)
    # observe() counts `value` in the first bucket whose upper bound is >= value.
    histogram._buckets[bisect_left(histogram._upper_bounds, value)].inc(count)


class _EngineSeries:
    """The labelled children of every request metric for one engine (looked up once, not
    per observation: recording runs for every output of every step)."""

    def __init__(self, families: dict[str, Any], model_name: str, engine: int) -> None:
        for attr, family in families.items():
            if attr != "success":  # labelled by finish reason too: see success()
                setattr(self, attr, family.labels(model_name, str(engine)))
        self._success = families["success"]
        self._labels = (model_name, str(engine))
        for reason in _FINISH_REASONS:
            self.success(reason)

    def success(self, finish_reason: str) -> Any:
        """The request_success counter of `finish_reason`."""
        return self._success.labels(*self._labels, finish_reason)


class PrometheusMetrics:
    """All metrics of one server, in a registry of its own (rendered by `render`).

    `num_engines` engines' series exist from the start (zero until used), so every name
    shows on the first scrape.
    """

    def __init__(self, model_name: str, max_model_len: int = 1 << 20,
                 num_engines: int = 1) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = EngineCollector(model_name)
        self.registry.register(self._engine)
        self._model_name = model_name
        reg = self.registry
        labels = ENGINE_LABELS
        tokens = token_buckets(max_model_len)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        # Attribute name on _EngineSeries -> labelled family.
        self._families: dict[str, Any] = {
            "prompt_tokens": counter("vllm:prompt_tokens", "Prompt tokens processed."),
            "generation_tokens": counter("vllm:generation_tokens", "Tokens generated."),
            "success": Counter("vllm:request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=reg),
            "iteration_tokens": histogram(
                "vllm:iteration_tokens_total",
                "Tokens per engine step: prompt tokens of the prefills it finished plus the "
                "tokens it generated.", _ITERATION_BUCKETS),
            "ttft": histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              _LATENCY_BUCKETS),
            # The mean of each request under upstream's older name and its newer one.
            "tpot": histogram("vllm:time_per_output_token_seconds",
                              "Mean time per output token of a request.", _TPOT_BUCKETS),
            "request_tpot": histogram("vllm:request_time_per_output_token_seconds",
                                      "Mean time per output token of a request.",
                                      _TPOT_BUCKETS),
            "e2e": histogram("vllm:e2e_request_latency_seconds",
                             "Arrival to finish of a request.", _LATENCY_BUCKETS),
            # One observation per step that gave a request new tokens after its first.
            "itl": histogram("vllm:inter_token_latency_seconds",
                             "Time between a request's successive outputs.", _ITL_BUCKETS),
            "queue_time": histogram("vllm:request_queue_time_seconds",
                                    "Arrival to first schedule of a request.", _PHASE_BUCKETS),
            "prefill_time": histogram("vllm:request_prefill_time_seconds",
                                      "First schedule to first token of a request.",
                                      _PHASE_BUCKETS),
            "decode_time": histogram("vllm:request_decode_time_seconds",
                                     "First token to last token of a request.",
                                     _PHASE_BUCKETS),
            "inference_time": histogram("vllm:request_inference_time_seconds",
                                        "First schedule to last token of a request (prefill "
                                        "and decode).", _PHASE_BUCKETS),
            "request_prompt_tokens": histogram("vllm:request_prompt_tokens",
                                               "Prompt tokens of a finished request.", tokens),
            "request_generation_tokens": histogram(
                "vllm:request_generation_tokens",
                "Tokens a finished request generated (all its sequences).", tokens),
            "params_n": histogram("vllm:request_params_n",
                                  "The n (sequences) of a finished request.", _N_BUCKETS),
            "params_max_tokens": histogram(
                "vllm:request_params_max_tokens",
                "The max_tokens of a finished request (what the context left, when it set "
                "none).", tokens),
        }
        self._series: dict[int, _EngineSeries] = {}
        for engine in range(num_engines):
            self._for_engine(engine)
        self._compile = Histogram(
            "vllm:structured_output_compile_seconds",
            "Compile time of structured-output constraints checked before admission.",
            ["model_name", "kind"], buckets=_COMPILE_BUCKETS, registry=reg,
        )

    def _for_engine(self, engine: int) -> _EngineSeries:
        series = self._series.get(engine)
        if series is None:
            series = self._series[engine] = _EngineSeries(
                self._families, self._model_name, engine)
        return series

    def record_engine_stats(self, stats: EngineCoreStats) -> None:
        """Stores the (single) engine's latest snapshot; under -dp the snapshots are read
        from the engine states given to `watch_engines`."""
        self._engine.stats = stats

    def watch_engines(self, engines: Callable[[], list[EngineState]]) -> None:
        """Exposes the data-parallel engines' snapshots, routing counts and health, each
        under its own `engine` label (read from `engines()` at every scrape)."""
        self._engine.engines = engines

    def describe_cache(self, cache_config: Any, num_blocks: list[int]) -> None:
        """Sets `vllm:cache_config_info` for each engine: the cache config's fields and the
        engine's KV block count (`num_blocks[i]` for engine i) as labels."""
        self._engine.cache_info = {
            engine: cache_config_labels(cache_config, blocks)
            for engine, blocks in enumerate(num_blocks)
        }

    def record_engine_dead(self) -> None:
        """Marks the engine as gone (vllm:engine_alive 0, counted in vllm:engine_dead_total)
        and drops its gauges: nothing runs or waits in it, and its KV cache is gone."""
        self._engine.engine_alive = False
        if self._engine.stats is not None:
            self._engine.stats = self._engine.stats.of_dead_engine()

    def set_num_frontend_requests(self, num: int) -> None:
        """Sets how many requests the API server is tracking."""
        self._engine.num_frontend_requests = num

    def record_output(
        self,
        stats: RequestStateStats,
        first_scheduled_time: float | None,
        num_new_tokens: int,
        now: float,
    ) -> None:
        """One engine output of a request: its first-scheduled time if the engine sent it,
        then its new tokens (TTFT on the first, inter-token latency after)."""
        self.record_outputs([(stats, first_scheduled_time, num_new_tokens)], now,
                            stats.engine_index)

    def record_outputs(
        self,
        outputs: Iterable[tuple[RequestStateStats, float | None, int]],
        now: float,
        engine_index: int = 0,
    ) -> None:
        """One step's engine outputs from engine `engine_index`, each (request stats,
        first-scheduled time or None, number of new tokens), recorded as record_output
        records each; the step's tokens are one observation of iteration_tokens_total.

        Per step rather than per output because a decode step gives every running request a
        token: the step's generation tokens are one counter increment, and the inter-token
        latencies, equal for all requests that also had tokens in the previous step, one
        histogram update per distinct value (per output, this cost more than the
        scheduler's whole update at large batches). Each request's stats learn the engine
        serving it (a request moved off a dead engine is then labelled with its new one)."""
        series = self._for_engine(engine_index)
        num_tokens = num_prompt = 0
        gaps: dict[float, int] = {}
        for stats, first_scheduled_time, num_new_tokens in outputs:
            stats.engine_index = engine_index
            if first_scheduled_time is not None:
                stats.on_scheduled(first_scheduled_time)
            if not num_new_tokens:
                continue
            previous = stats.last_token_time
            ttft = stats.on_tokens(num_new_tokens, now)
            if ttft is not None:
                series.ttft.observe(ttft)
                num_prompt += stats.num_prompt_tokens
            elif previous is not None:
                gap = now - previous
                gaps[gap] = gaps.get(gap, 0) + 1
            num_tokens += num_new_tokens
        for gap, count in gaps.items():
            observe_many(series.itl, gap, count)
        if num_prompt:
            series.prompt_tokens.inc(num_prompt)
        if num_tokens:
            series.generation_tokens.inc(num_tokens)
        if num_tokens or num_prompt:
            series.iteration_tokens.observe(num_tokens + num_prompt)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        """A request ended (including aborts and errors)."""
        series = self._for_engine(stats.engine_index)
        series.success(stats.finish_reason).inc()
        series.e2e.observe(stats.e2e_latency)
        if stats.mean_time_per_output_token is not None:
            series.tpot.observe(stats.mean_time_per_output_token)
            series.request_tpot.observe(stats.mean_time_per_output_token)
        series.request_prompt_tokens.observe(stats.num_prompt_tokens)
        series.request_generation_tokens.observe(stats.num_generation_tokens)
        series.params_n.observe(stats.n)
        if stats.max_tokens is not None:
            series.params_max_tokens.observe(stats.max_tokens)
        # A phase the request never reached (aborted while queued) is not observed.
        for phase in ("queue_time", "prefill_time", "decode_time", "inference_time"):
            seconds = getattr(stats, phase)
            if seconds is not None:
                getattr(series, phase).observe(seconds)

    def record_compile(self, kind: str, seconds: float) -> None:
        """One structured-output compile check (a cache hit is fast)."""
        self._compile.labels(self._model_name, kind).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
