"""Tests for the stats record (vllm/v1/metrics/engine_stats.py) on its way from the engine core
to /metrics: the wire encoding between the processes, the merge of several engines' records,
and the Prometheus render."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm.v1.metrics.engine_stats import (
    EngineCoreStats,
    GrammarStats,
    KVCacheStats,
    SpecDecodeStats,
)
from vllm.v1.metrics.prometheus import PrometheusMetrics

MODEL = "test-model"


def _stats(kv: dict | None = None, spec: dict | None = None, **changes: object
           ) -> EngineCoreStats:
    """A record whose fields all differ, so a field rendered under the wrong name shows;
    `kv` and `spec` change fields of those parts."""
    stats = EngineCoreStats(
        num_running=3,
        num_waiting=5,
        num_preemptions=7,
        num_aborted_requests=2,
        timestamp=1_700_000_000.25,
        kv=KVCacheStats(usage=0.375, num_free_blocks=40, num_blocks=64,
                        prefix_cache_queries=1200, prefix_cache_hits=480),
        spec=SpecDecodeStats(num_steps=11, num_draft_tokens=30, num_accepted_tokens=12,
                             num_forced_tokens=20, num_forced_kept_tokens=9,
                             num_fast_forwarded_requests=4,
                             num_accepted_tokens_per_pos=[8, 3, 1]),
        grammar=GrammarStats([("guidance", "fallback", 4), ("xgrammar", "first_choice", 9)]),
    )
    stats = msgspec.structs.replace(
        stats, kv=msgspec.structs.replace(stats.kv, **(kv or {})),
        spec=msgspec.structs.replace(stats.spec, **(spec or {})))
    return msgspec.structs.replace(stats, **changes)


def _numbers(stats: EngineCoreStats) -> list[tuple[str, str]]:
    """(part, field) of every number in the record but the timestamp; part "" is the top.
    (Lists of numbers, such as the per-position counts, are checked on their own.)"""
    out = [("", f.name) for f in msgspec.structs.fields(stats)
           if isinstance(getattr(stats, f.name), (int, float)) and f.name != "timestamp"]
    for part in ("kv", "spec"):
        owner = getattr(stats, part)
        out += [(part, f.name) for f in msgspec.structs.fields(owner)
                if isinstance(getattr(owner, f.name), (int, float))]
    return out


def _wire(stats: EngineCoreStats) -> EngineCoreStats:
    """The record after the trip the engine core's STATS payload takes: encoded by a plain
    msgpack encoder (EngineCoreProc), decoded by the typed decoder (EngineCoreClient)."""
    payload = msgspec.msgpack.Encoder().encode(stats)
    return msgspec.msgpack.Decoder(EngineCoreStats).decode(payload)


def _samples(metrics: PrometheusMetrics) -> dict[str, tuple[str, float]]:
    """The rendered gauges and counters as {sample name: (metric type, value)}, for MODEL."""
    out: dict[str, tuple[str, float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if (sample.labels == {"model_name": MODEL, "engine": "0"}
                    and family.type in ("gauge", "counter")):
                out[sample.name] = (family.type, sample.value)
    return out


def test_record_round_trips_through_the_process_boundary_encoding() -> None:
    stats = _stats()
    decoded = _wire(stats)
    assert decoded == stats
    assert type(decoded) is EngineCoreStats
    # The decoder checks each field's type, so a mismatched sender fails loudly here.
    fields = list(msgspec.structs.astuple(stats))
    fields[0] = "many"
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(EngineCoreStats).decode(msgspec.msgpack.encode(fields))


def test_same_as_ignores_only_the_timestamp() -> None:
    stats = _stats()
    assert stats.same_as(_stats(timestamp=stats.timestamp + 5.0))
    assert not stats.same_as(None)
    for part, name in _numbers(stats):
        if part:
            changed = _stats(**{part: {name: getattr(getattr(stats, part), name) + 1}})
        else:
            changed = _stats(**{name: getattr(stats, name) + 1})
        assert not stats.same_as(changed), (part, name)
    more = GrammarStats(stats.grammar.backends + [("x", "y", 1)])
    assert not stats.same_as(_stats(grammar=more))


def test_prometheus_renders_the_record_as_the_vllm_gauges_and_counters() -> None:
    metrics = PrometheusMetrics(MODEL)
    before = _samples(metrics)
    # Before the first snapshot only the front end's own engine gauges exist.
    assert "vllm:num_requests_running" not in before
    # The API server's own metrics describe no single engine: model_name only.
    server_wide = {sample.name: sample.value
                   for family in text_string_to_metric_families(metrics.render().decode())
                   for sample in family.samples if sample.labels == {"model_name": MODEL}}
    assert server_wide["vllm:engine_alive"] == 1.0
    assert server_wide["vllm:num_requests_api_server"] == 0.0
    stats = _stats()
    metrics.record_engine_stats(_wire(stats))
    after = _samples(metrics)
    rendered = {k: v for k, v in after.items() if k not in before}
    # One sample per number: a field added to the record must be rendered too (timestamp is
    # not rendered; the grammar part is a labelled counter, checked below), plus the two
    # speculative-decoding ratios and the fast-forward mean derived from the counters.
    assert len(rendered) == len(_numbers(stats)) + 3
    assert rendered == {
        "vllm:num_requests_running": ("gauge", 3.0),
        "vllm:num_requests_waiting": ("gauge", 5.0),
        "vllm:kv_cache_usage_perc": ("gauge", 0.375),
        "vllm:kv_cache_free_blocks": ("gauge", 40.0),
        "vllm:kv_cache_total_blocks": ("gauge", 64.0),
        "vllm:num_preemptions_total": ("counter", 7.0),
        "vllm:prefix_cache_queries_total": ("counter", 1200.0),
        "vllm:prefix_cache_hits_total": ("counter", 480.0),
        "vllm:engine_aborted_requests_total": ("counter", 2.0),
        "vllm:spec_decode_num_drafts_total": ("counter", 11.0),
        "vllm:spec_decode_num_draft_tokens_total": ("counter", 30.0),
        "vllm:spec_decode_num_accepted_tokens_total": ("counter", 12.0),
        "vllm:spec_decode_draft_acceptance_rate": ("gauge", 0.4),
        "vllm:spec_decode_mean_accepted_length": ("gauge", 1 + 12 / 11),
        "vllm:fast_forward_forced_tokens_total": ("counter", 20.0),
        "vllm:fast_forward_passes_saved_total": ("counter", 9.0),
        "vllm:fast_forward_requests_total": ("counter", 4.0),
        "vllm:fast_forward_tokens_per_request": ("gauge", 9 / 4),
    }
    # The decoded record renders exactly as the one the engine core built.
    from_wire = metrics.render()
    metrics.record_engine_stats(stats)
    assert metrics.render() == from_wire


def test_spec_decode_ratios_are_absent_before_any_draft() -> None:
    metrics = PrometheusMetrics(MODEL)
    metrics.record_engine_stats(_stats(spec=dict(num_steps=0, num_draft_tokens=0,
                                                 num_accepted_tokens=0)))
    rendered = _samples(metrics)
    assert rendered["vllm:spec_decode_num_draft_tokens_total"] == ("counter", 0.0)
    assert "vllm:spec_decode_draft_acceptance_rate" not in rendered


def test_fast_forward_mean_is_absent_before_any_fast_forwarded_request() -> None:
    metrics = PrometheusMetrics(MODEL)
    metrics.record_engine_stats(_stats(spec=dict(num_fast_forwarded_requests=0)))
    rendered = _samples(metrics)
    assert rendered["vllm:fast_forward_requests_total"] == ("counter", 0.0)
    assert "vllm:fast_forward_tokens_per_request" not in rendered


def test_backend_choices_render_as_one_labelled_counter() -> None:
    metrics = PrometheusMetrics(MODEL)
    metrics.record_engine_stats(_wire(_stats()))
    found = {
        (sample.labels["backend"], sample.labels["reason"]): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
        if sample.name == "vllm:structured_output_backend_total"
    }
    assert found == {("guidance", "fallback"): 4, ("xgrammar", "first_choice"): 9}


def _engine(running: int, usage: float, blocks: int, backends: list) -> EngineCoreStats:
    return EngineCoreStats(
        num_running=running, num_waiting=1, num_preemptions=2, num_aborted_requests=1,
        timestamp=float(running),
        kv=KVCacheStats(usage=usage, num_free_blocks=blocks // 2, num_blocks=blocks,
                        prefix_cache_queries=10, prefix_cache_hits=4),
        spec=SpecDecodeStats(num_steps=running, num_draft_tokens=3, num_accepted_tokens=2),
        grammar=GrammarStats(backends),
    )


def test_merge_adds_counts_and_weights_usage_by_blocks() -> None:
    a = _engine(3, 0.5, 100, [("xgrammar", "first_choice", 2)])
    b = _engine(1, 0.1, 300, [("xgrammar", "first_choice", 1), ("guidance", "fallback", 4)])
    total = EngineCoreStats.merge([a, b])
    assert (total.num_running, total.num_waiting, total.kv.num_blocks) == (4, 2, 400)
    assert (total.kv.num_free_blocks, total.num_preemptions, total.num_aborted_requests) == (
        200, 4, 2)
    assert total.kv.usage == pytest.approx((0.5 * 100 + 0.1 * 300) / 400)
    assert total.grammar.backends == [("guidance", "fallback", 4), ("xgrammar", "first_choice", 3)]
    assert (total.spec.num_steps, total.spec.num_draft_tokens,
            total.spec.num_accepted_tokens) == (4, 6, 4)
    assert total.timestamp == 3.0


def test_merge_sums_every_counter_of_every_part() -> None:
    """A counter added to a part is merged without a line of its own."""
    stats = _stats()
    total = EngineCoreStats.merge([stats, stats])
    for part, name in _numbers(stats):
        if (part, name) == ("kv", "usage"):
            assert total.kv.usage == stats.kv.usage
            continue
        owner, merged = (getattr(stats, part), getattr(total, part)) if part else (stats, total)
        assert getattr(merged, name) == 2 * getattr(owner, name), (part, name)


def _by_labels(metrics: PrometheusMetrics, sample_name: str) -> dict[tuple, float]:
    """{sorted (label, value) pairs but model_name: value} of one sample name."""
    return {
        tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name")): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples if sample.name == sample_name
    }


def test_accepted_drafts_are_counted_and_rendered_by_position() -> None:
    spec = SpecDecodeStats()
    spec.record(num_drafts=3, num_accepted=2)
    spec.record(num_drafts=2, num_accepted=0)
    spec.record(num_drafts=4, num_accepted=4)
    assert spec.num_accepted_tokens_per_pos == [2, 2, 1, 1]
    frozen = spec.snapshot()
    spec.record(num_drafts=1, num_accepted=1)
    assert frozen.num_accepted_tokens_per_pos == [2, 2, 1, 1]  # a copy, not a view
    merged = SpecDecodeStats.merge([frozen, SpecDecodeStats(num_accepted_tokens_per_pos=[5])])
    assert merged.num_accepted_tokens_per_pos == [7, 2, 1, 1]
    metrics = PrometheusMetrics(MODEL)
    metrics.record_engine_stats(_wire(_stats()))
    assert _by_labels(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == {
        (("engine", "0"), ("position", str(i))): float(n) for i, n in enumerate([8, 3, 1])}


def test_data_parallel_engines_each_render_their_own_snapshot() -> None:
    from types import SimpleNamespace

    def state(index: int, stats: EngineCoreStats | None) -> SimpleNamespace:
        """What the collector reads of a data-parallel EngineState."""
        return SimpleNamespace(index=index, stats=stats, alive=True, num_routed=0)

    states = [state(0, _stats(num_running=2, kv={"usage": 0.5})),
              state(1, _stats(num_running=7, kv={"usage": 0.25})),
              state(2, None)]  # no snapshot yet: no series
    metrics = PrometheusMetrics(MODEL, num_engines=3)
    metrics.watch_engines(lambda: states)
    assert _by_labels(metrics, "vllm:num_requests_running") == {
        (("engine", "0"),): 2.0, (("engine", "1"),): 7.0}
    assert _by_labels(metrics, "vllm:kv_cache_usage_perc") == {
        (("engine", "0"),): 0.5, (("engine", "1"),): 0.25}
    assert set(_by_labels(metrics, "vllm:num_preemptions_total")) == {
        (("engine", "0"),), (("engine", "1"),)}
    # The request metrics exist for every engine from the start.
    assert set(_by_labels(metrics, "vllm:prompt_tokens_total")) == {
        (("engine", str(i)),) for i in range(3)}


def test_cache_config_info_labels_each_engine_with_its_cache() -> None:
    from vllm.config import CacheConfig

    metrics = PrometheusMetrics(MODEL, num_engines=2)
    metrics.describe_cache(CacheConfig(block_size=32, cache_dtype="fp8"), [100, 120])
    info = {dict(labels)["engine"]: dict(labels)
            for labels in _by_labels(metrics, "vllm:cache_config_info")}
    assert set(info) == {"0", "1"}
    assert info["0"]["block_size"] == "32" and info["0"]["cache_dtype"] == "fp8"
    assert (info["0"]["num_gpu_blocks"], info["1"]["num_gpu_blocks"]) == ("100", "120")
    assert set(_by_labels(metrics, "vllm:cache_config_info").values()) == {1.0}
