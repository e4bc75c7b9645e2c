"""The /metrics collector of what the engine cores report: their latest stats snapshots
(queues, KV and prefix cache, drafts, grammar backends), the cache configuration, and the
API server's view of the engines (alive, dead, routed requests).

Every engine metric carries the labels `model_name` and `engine` (the data-parallel rank,
"0" with one engine), as upstream vLLM's do: under `-dp N` each engine has its own series,
and a dashboard sums them. The API server's own metrics (engine_alive, engine_dead,
num_requests_api_server) describe no single engine and carry `model_name` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm.v1.metrics.engine_stats import EngineCoreStats

if TYPE_CHECKING:
    from vllm.v1.engine.data_parallel import EngineState

ENGINE_LABELS = ["model_name", "engine"]


def cache_config_labels(cache_config: Any, num_blocks: int) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` for one engine: every field of the cache
    config (a dataclass, e.g. CacheConfig) as text, and `num_gpu_blocks`, the KV blocks the
    engine allocated (upstream's label name, whatever the device)."""
    labels = {f.name: str(getattr(cache_config, f.name))
              for f in dataclasses.fields(cache_config)}
    labels["num_gpu_blocks"] = str(num_blocks)
    return labels


class _Families:
    """One scrape's engine metric families, filled engine by engine."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.families: dict[str, Metric] = {}

    def add(self, kind: str, name: str, doc: str, engine: int, value: float,
            extra: dict[str, str] | None = None) -> None:
        """One sample of the gauge or counter `name` for `engine` (created on first use)."""
        extra = extra or {}
        family = self.families.get(name)
        if family is None:
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = self.families[name] = cls(name, doc, labels=ENGINE_LABELS + list(extra))
        family.add_metric([self.model_name, str(engine), *extra.values()], value)


class EngineCollector(Collector):
    """Exposes the engines' latest snapshots; counters are each engine's cumulative values.

    With one engine, `stats` is its snapshot (engine "0"); under `-dp`, `engines` returns
    every engine's state, whose own snapshot is rendered under its index.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineCoreStats | None = None
        self.engine_alive = True
        self.num_frontend_requests = 0
        # The data-parallel engines' states, read at every scrape (None: one engine).
        self.engines: Callable[[], list[EngineState]] | None = None
        # Per engine index: the labels of vllm:cache_config_info (empty until known).
        self.cache_info: dict[int, dict[str, str]] = {}

    def collect(self) -> Iterator[Metric]:
        """The current values (called by the registry on every scrape)."""
        yield from self._server_metrics()
        families = _Families(self.model_name)
        for engine, labels in sorted(self.cache_info.items()):
            families.add("gauge", "vllm:cache_config_info",
                         "The KV cache configuration of the engine, as labels (value 1).",
                         engine, 1.0, labels)
        for engine, stats in self._snapshots():
            self._engine_metrics(families, engine, stats)
        yield from families.families.values()

    def _snapshots(self) -> list[tuple[int, EngineCoreStats]]:
        """(engine index, its latest snapshot) of every engine that sent one."""
        if self.engines is None:
            return [] if self.stats is None else [(0, self.stats)]
        return [(state.index, state.stats) for state in self.engines()
                if state.stats is not None]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _server_metrics(self) -> Iterator[Metric]:
        """What the API server knows without an engine snapshot: liveness and routing."""
        yield self._gauge("vllm:engine_alive", "1 while the engine-core process serves.",
                          1.0 if self.engine_alive else 0.0)
        # Engines never come back, so counting the dead ones now is a valid counter.
        if self.engines is not None:
            num_dead = sum(1 for state in self.engines() if not state.alive)
        else:
            num_dead = 0 if self.engine_alive else 1
        dead = CounterMetricFamily(
            "vllm:engine_dead", "Engine cores that died (a worker died, the process was "
            "killed, or a step failed) since startup.", labels=["model_name"])
        dead.add_metric([self.model_name], num_dead)
        yield dead
        yield self._gauge("vllm:num_requests_api_server",
                          "Requests the API server is still tracking (admitted, not yet "
                          "finished).", self.num_frontend_requests)
        if self.engines is None:
            return
        routed = CounterMetricFamily(
            "vllm:data_parallel_requests_routed",
            "Requests the API server sent to each data-parallel engine core.",
            labels=ENGINE_LABELS,
        )
        alive = GaugeMetricFamily(
            "vllm:data_parallel_engine_alive", "1 while the data-parallel engine serves.",
            labels=ENGINE_LABELS,
        )
        for state in self.engines():
            routed.add_metric([self.model_name, str(state.index)], state.num_routed)
            alive.add_metric([self.model_name, str(state.index)], 1.0 if state.alive else 0.0)
        yield routed
        yield alive

    def _engine_metrics(self, out: _Families, engine: int, s: EngineCoreStats) -> None:
        """One engine's snapshot: queues, KV cache, prefix cache, drafts, grammars."""
        kv, spec = s.kv, s.spec

        def gauge(name: str, doc: str, value: float) -> None:
            out.add("gauge", name, doc, engine, value)

        def counter(name: str, doc: str, value: float) -> None:
            out.add("counter", name, doc, engine, value)

        gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks owned by requests (0-1).",
              kv.usage)
        gauge("vllm:kv_cache_free_blocks",
              "KV blocks no request owns (free or evictable prefix-cache blocks).",
              kv.num_free_blocks)
        gauge("vllm:kv_cache_total_blocks", "KV blocks in the cache.", kv.num_blocks)
        counter("vllm:num_preemptions", "Preemptions since startup.", s.num_preemptions)
        counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                kv.prefix_cache_queries)
        counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                kv.prefix_cache_hits)
        counter("vllm:engine_aborted_requests",
                "Aborts that ended a request still alive in the engine core.",
                s.num_aborted_requests)
        counter("vllm:spec_decode_num_drafts",
                "Verification steps of a request that carried drafted tokens.", spec.num_steps)
        counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified.",
                spec.num_draft_tokens)
        counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens the model kept.",
                spec.num_accepted_tokens)
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            out.add("counter", "vllm:spec_decode_num_accepted_tokens_per_pos",
                    "Drafted tokens the model kept, by position in the draft (0: first).",
                    engine, count, {"position": str(position)})
        if spec.num_draft_tokens:
            gauge("vllm:spec_decode_draft_acceptance_rate",
                  "Kept drafted tokens over drafted tokens, since startup.",
                  spec.num_accepted_tokens / spec.num_draft_tokens)
            gauge("vllm:spec_decode_mean_accepted_length",
                  "Tokens a verification step produced per request, on average "
                  "(1 + kept drafts).", 1 + spec.num_accepted_tokens / spec.num_steps)
        counter("vllm:fast_forward_forced_tokens",
                "Drafted tokens that a grammar forced (grammar fast-forward).",
                spec.num_forced_tokens)
        counter("vllm:fast_forward_passes_saved",
                "Forced tokens kept: forward passes their requests did not need.",
                spec.num_forced_kept_tokens)
        counter("vllm:fast_forward_requests",
                "Finished requests that kept at least one forced token.",
                spec.num_fast_forwarded_requests)
        if spec.num_fast_forwarded_requests:
            gauge("vllm:fast_forward_tokens_per_request",
                  "Forced tokens kept per fast-forwarded request, since startup.",
                  spec.num_forced_kept_tokens / spec.num_fast_forwarded_requests)
        backend_doc = ("Structured-output constraints compiled in the engine, by backend and "
                       "reason (fallback: an earlier backend could not enforce the "
                       "constraint exactly).")
        for backend, reason, count in s.grammar.backends:
            out.add("counter", "vllm:structured_output_backend", backend_doc, engine, count,
                    {"backend": backend, "reason": reason})
