"""Prometheus collectors for one server: engine gauges and request latency histograms."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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


class _EngineCollector(Collector):
    """Exposes the latest engine-core snapshot; counters are the engine's cumulative values."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineCoreStats | None = None
        self.engine_alive = True
        self.num_frontend_requests = 0
        # The data-parallel engines' states, read at every scrape (None: one engine).
        self.engines: Callable[[], list[EngineState]] | None = None

    def collect(self) -> Iterator[Metric]:
        """The current values (called by the registry on every scrape)."""
        yield from self._server_metrics()
        if self.stats is not None:
            yield from self._engine_metrics(self.stats)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def _server_metrics(self) -> Iterator[Metric]:
        """What the API server knows without an engine snapshot: liveness and routing."""
        yield self._gauge("vllm:engine_alive", "1 while the engine-core process serves.",
                          1.0 if self.engine_alive else 0.0)
        # Engines never come back, so counting the dead ones now is a valid counter.
        if self.engines is not None:
            num_dead = sum(1 for state in self.engines() if not state.alive)
        else:
            num_dead = 0 if self.engine_alive else 1
        yield self._counter("vllm:engine_dead",
                            "Engine cores that died (a worker died, the process was killed, "
                            "or a step failed) since startup.", num_dead)
        yield self._gauge("vllm:num_requests_api_server",
                          "Requests the API server is still tracking (admitted, not yet "
                          "finished).", self.num_frontend_requests)
        if self.engines is None:
            return
        labels = ["model_name", "engine"]
        routed = CounterMetricFamily(
            "vllm:data_parallel_requests_routed",
            "Requests the API server sent to each data-parallel engine core.", labels=labels,
        )
        alive = GaugeMetricFamily(
            "vllm:data_parallel_engine_alive", "1 while the data-parallel engine serves.",
            labels=labels,
        )
        for state in self.engines():
            routed.add_metric([self.model_name, str(state.index)], state.num_routed)
            alive.add_metric([self.model_name, str(state.index)], 1.0 if state.alive else 0.0)
        yield routed
        yield alive

    def _engine_metrics(self, s: EngineCoreStats) -> Iterator[Metric]:
        """The engine core's latest snapshot: queues, KV cache, prefix cache, drafts."""
        gauge, counter = self._gauge, self._counter
        kv, spec = s.kv, s.spec
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks owned by requests (0-1).",
                    kv.usage)
        yield gauge("vllm:kv_cache_free_blocks",
                    "KV blocks no request owns (free or evictable prefix-cache blocks).",
                    kv.num_free_blocks)
        yield gauge("vllm:kv_cache_total_blocks", "KV blocks in the cache.", kv.num_blocks)
        yield counter("vllm:num_preemptions", "Preemptions since startup.", s.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      kv.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      kv.prefix_cache_hits)
        yield counter("vllm:engine_aborted_requests",
                      "Aborts that ended a request still alive in the engine core.",
                      s.num_aborted_requests)
        yield counter("vllm:spec_decode_num_drafts",
                      "Verification steps of a request that carried drafted tokens.",
                      spec.num_steps)
        yield counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified.",
                      spec.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens",
                      "Drafted tokens the model kept.", spec.num_accepted_tokens)
        if spec.num_draft_tokens:
            yield gauge("vllm:spec_decode_draft_acceptance_rate",
                        "Kept drafted tokens over drafted tokens, since startup.",
                        spec.num_accepted_tokens / spec.num_draft_tokens)
            yield gauge("vllm:spec_decode_mean_accepted_length",
                        "Tokens a verification step produced per request, on average "
                        "(1 + kept drafts).",
                        1 + spec.num_accepted_tokens / spec.num_steps)
        yield counter("vllm:fast_forward_forced_tokens",
                      "Drafted tokens that a grammar forced (grammar fast-forward).",
                      spec.num_forced_tokens)
        yield counter("vllm:fast_forward_passes_saved",
                      "Forced tokens kept: forward passes their requests did not need.",
                      spec.num_forced_kept_tokens)
        yield counter("vllm:fast_forward_requests",
                      "Finished requests that kept at least one forced token.",
                      spec.num_fast_forwarded_requests)
        if spec.num_fast_forwarded_requests:
            yield gauge("vllm:fast_forward_tokens_per_request",
                        "Forced tokens kept per fast-forwarded request, since startup.",
                        spec.num_forced_kept_tokens / spec.num_fast_forwarded_requests)
        choices = CounterMetricFamily(
            "vllm:structured_output_backend",
            "Structured-output constraints compiled in the engine, by backend and reason "
            "(fallback: an earlier backend could not enforce the constraint exactly).",
            labels=["model_name", "backend", "reason"],
        )
        for backend, reason, count in s.grammar.backends:
            choices.add_metric([self.model_name, backend, reason], count)
        yield choices


class PrometheusMetrics:
    """All metrics of one server, in a registry of its own (rendered by `render`)."""

    def __init__(self, model_name: str, max_model_len: int = 1 << 20) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        labels = ["model_name"]
        reg = self.registry
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=reg
        ).labels(model_name)
        self._generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=reg
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            labels + ["finished_reason"], registry=reg,
        )
        self._model_name = model_name

        def histogram(name: str, doc: str, buckets) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self._ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self._tpot = histogram(
            "vllm:time_per_output_token_seconds", "Mean time per output token of a request.",
            _TPOT_BUCKETS,
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish of a request.",
            _LATENCY_BUCKETS,
        )
        # Upstream vLLM's names, beside ours: one observation per finished request (the
        # inter-token one per step that gave a request new tokens after its first).
        self._itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between a request's successive outputs.",
            _ITL_BUCKETS,
        )
        self._queue_time = histogram(
            "vllm:request_queue_time_seconds", "Arrival to first schedule of a request.",
            _PHASE_BUCKETS,
        )
        self._prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "First schedule to first token of a request.",
            _PHASE_BUCKETS,
        )
        self._decode_time = histogram(
            "vllm:request_decode_time_seconds", "First token to last token of a request.",
            _PHASE_BUCKETS,
        )
        token_bucket_list = token_buckets(max_model_len)
        self._request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a finished request.",
            token_bucket_list,
        )
        self._request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Tokens a finished request generated.",
            token_bucket_list,
        )
        self._compile = Histogram(
            "vllm:structured_output_compile_seconds",
            "Compile time of structured-output constraints checked before admission.",
            labels + ["kind"], buckets=_COMPILE_BUCKETS, registry=reg,
        )

    def record_engine_stats(self, stats: EngineCoreStats) -> None:
        """Stores the engine's latest snapshot."""
        self._engine.stats = stats

    def watch_engines(self, engines: Callable[[], list[EngineState]]) -> None:
        """Exposes the data-parallel engines' routing counts and health per engine."""
        self._engine.engines = engines

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
        self.record_outputs([(stats, first_scheduled_time, num_new_tokens)], now)

    def record_outputs(
        self, outputs: Iterable[tuple[RequestStateStats, float | None, int]], now: float
    ) -> None:
        """One step's engine outputs, each (request stats, first-scheduled time or None,
        number of new tokens), recorded as record_output records each.

        Per step rather than per output because a decode step gives every running request a
        token: the step's generation tokens are one counter increment, and the inter-token
        latencies, equal for all requests that also had tokens in the previous step, one
        histogram update per distinct value (per output, this cost more than the
        scheduler's whole update at large batches)."""
        num_tokens = 0
        gaps: dict[float, int] = {}
        for stats, first_scheduled_time, num_new_tokens in outputs:
            if first_scheduled_time is not None:
                stats.on_scheduled(first_scheduled_time)
            if not num_new_tokens:
                continue
            previous = stats.last_token_time
            ttft = stats.on_tokens(num_new_tokens, now)
            if ttft is not None:
                self.record_first_token(ttft, stats.num_prompt_tokens)
            elif previous is not None:
                gap = now - previous
                gaps[gap] = gaps.get(gap, 0) + 1
            num_tokens += num_new_tokens
        for gap, count in gaps.items():
            observe_many(self._itl, gap, count)
        if num_tokens:
            self.record_generation_tokens(num_tokens)

    def record_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        """A request's prefill finished: its TTFT and prompt tokens."""
        self._ttft.observe(ttft)
        self._prompt_tokens.inc(num_prompt_tokens)

    def record_generation_tokens(self, num_tokens: int) -> None:
        """Tokens generated in one step for one request."""
        self._generation_tokens.inc(num_tokens)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        """A request ended (including aborts and errors)."""
        self._success.labels(self._model_name, stats.finish_reason).inc()
        self._e2e.observe(stats.e2e_latency)
        if stats.mean_time_per_output_token is not None:
            self._tpot.observe(stats.mean_time_per_output_token)
        self._request_prompt_tokens.observe(stats.num_prompt_tokens)
        self._request_generation_tokens.observe(stats.num_generation_tokens)
        # A phase the request never reached (aborted while queued) is not observed.
        if stats.queue_time is not None:
            self._queue_time.observe(stats.queue_time)
        if stats.prefill_time is not None:
            self._prefill_time.observe(stats.prefill_time)
        if stats.decode_time is not None:
            self._decode_time.observe(stats.decode_time)

    def record_compile(self, kind: str, seconds: float) -> None:
        """One structured-output compile check (a cache hit is fast)."""
        self._compile.labels(self._model_name, kind).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
