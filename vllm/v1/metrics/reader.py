"""Metrics as plain objects (`Counter`, `Gauge`, `Histogram`, `Vector`), the shapes of
upstream vLLM's `vllm.v1.metrics.reader`, read from one Prometheus registry.

`LLM.get_metrics()` reads its engine's own registry, so two engines in one process never see
each other's numbers; `get_metrics_snapshot()` with no argument reads the process-global
registry, as upstream's does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.samples import Sample


@dataclass
class Metric:
    """One time series: the metric's name and its labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing count."""

    value: int


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Vector(Metric):
    """Counts indexed by position (one counter per `position` label value, in order)."""

    values: list[int]


@dataclass
class Histogram(Metric):
    """Observations: how many, their sum, and the cumulative count at each upper bound
    (`buckets` maps the bound's text, e.g. "0.5" or "+Inf", to a count)."""

    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)


def get_metrics_snapshot(registry: CollectorRegistry | None = None) -> list[Metric]:
    """Every `vllm:` metric of `registry` (default: the global registry) as a list of
    Counter, Gauge, Histogram and Vector objects, one per label set."""
    registry = REGISTRY if registry is None else registry
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "counter":
            out.extend(_counters(family.name, family.samples))
        elif family.type == "gauge":
            for sample in family.samples:
                out.append(Gauge(family.name, dict(sample.labels), float(sample.value)))
        elif family.type == "histogram":
            out.extend(_histograms(family.name, family.samples))
    return out


def _counters(name: str, samples: list[Sample]) -> list[Metric]:
    """Counter objects of one counter family; a family with a `position` label is one Vector
    per remaining label set."""
    totals = [s for s in samples if s.name.endswith("_total") or s.name == name]
    if totals and all("position" in s.labels for s in totals):
        grouped: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
        for s in totals:
            rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "position"))
            grouped.setdefault(rest, {})[int(s.labels["position"])] = int(s.value)
        return [
            Vector(name, dict(rest), [by_pos.get(i, 0) for i in range(max(by_pos) + 1)])
            for rest, by_pos in grouped.items()
        ]
    return [Counter(name, dict(s.labels), int(s.value)) for s in totals]


def _histograms(name: str, samples: list[Sample]) -> list[Metric]:
    """Histogram objects of one histogram family, one per label set."""
    grouped: dict[tuple[tuple[str, str], ...], Histogram] = {}
    for s in samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        hist = grouped.get(key)
        if hist is None:
            hist = grouped[key] = Histogram(name, labels, count=0, sum=0.0)
        if s.name.endswith("_bucket"):
            hist.buckets[s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            hist.count = int(s.value)
        elif s.name.endswith("_sum"):
            hist.sum = float(s.value)
    return list(grouped.values())
