"""Serving metrics from per-request results: throughput, latency statistics, goodput."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vllm.benchmarks.endpoint_request_func import RequestFuncOutput

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass
class MetricStats:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    # (percentile, value) pairs, e.g. [(99.0, 12.5)].
    percentiles: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class BenchmarkMetrics:
    """Everything a run reports; latencies in ms, throughputs per second of wall time."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    # None unless SLOs were given.
    request_goodput: float | None
    stats: dict[str, MetricStats]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (stats flattened as mean_ttft_ms, p99_ttft_ms, ...)."""
        out = {k: v for k, v in asdict(self).items() if k != "stats"}
        for name, s in self.stats.items():
            out[f"mean_{name}_ms"] = s.mean
            out[f"median_{name}_ms"] = s.median
            out[f"std_{name}_ms"] = s.std
            for p, value in s.percentiles:
                out[f"p{_pct_label(p)}_{name}_ms"] = value
        return out


def parse_percentiles(text: str) -> list[float]:
    """Parse "50,90,99" into [50.0, 90.0, 99.0]. Raises ValueError for values outside (0, 100]."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = float(part)
        except ValueError as exc:
            raise ValueError(f"metric_percentiles: {part!r} is not a number") from exc
        if not 0.0 < value <= 100.0:
            raise ValueError(f"metric_percentiles: {value} is not in (0, 100]")
        values.append(value)
    if not values:
        raise ValueError("metric_percentiles: no percentile given")
    return values


def parse_metric_names(text: str) -> list[str]:
    """Parse "ttft,tpot" into ["ttft", "tpot"]. Raises ValueError for unknown names."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names:
        if name not in LATENCY_METRICS:
            raise ValueError(
                f"percentile_metrics: {name!r} is not one of {', '.join(LATENCY_METRICS)}"
            )
    return names


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """Parse SLOs like ["ttft:300", "tpot:50"] (milliseconds) into {"ttft": 300.0, ...}.

    Raises ValueError for a malformed item, an unknown metric (only ttft, tpot, e2el have
    per-request values) or a negative bound.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip()
        if not sep:
            raise ValueError(f"goodput: {item!r} is not NAME:MILLISECONDS")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput: {name!r} is not one of ttft, tpot, e2el")
        try:
            bound = float(value)
        except ValueError as exc:
            raise ValueError(f"goodput: {value!r} in {item!r} is not a number") from exc
        if bound < 0:
            raise ValueError(f"goodput: {name} bound must be non-negative, got {bound}")
        slos[name] = bound
    return slos


def output_token_count(
    out: RequestFuncOutput, count_tokens: Callable[[str], int] | None = None
) -> int:
    """Tokens a request generated: the server's usage count, else the tokenizer's count of
    its text, else the number of text chunks received."""
    if out.output_tokens is not None:
        return out.output_tokens
    if count_tokens is not None:
        return count_tokens(out.generated_text)
    return (1 if out.generated_text else 0) + len(out.itl)


def calculate_metrics(
    outputs: Sequence[RequestFuncOutput],
    duration_s: float,
    selected_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    percentiles: Sequence[float] = (99.0,),
    goodput: dict[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> BenchmarkMetrics:
    """Compute the run's metrics from its successful outputs; failed ones count in `failed`.

    TPOT of a request is (latency - ttft) / (output tokens - 1), defined for 2+ tokens.
    Goodput counts successful requests that meet every SLO (ms). Raises ValueError for a
    non-positive duration.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s: must be positive, got {duration_s}")
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    total_in = total_out = completed = good = 0
    for out in outputs:
        if not out.success:
            continue
        completed += 1
        n_out = output_token_count(out, count_tokens)
        total_in += out.prompt_len
        total_out += n_out
        e2els.append(out.latency)
        itls.extend(out.itl)
        if out.generated_text:
            ttfts.append(out.ttft)
        tpot = (out.latency - out.ttft) / (n_out - 1) if n_out > 1 else None
        if tpot is not None:
            tpots.append(tpot)
        if goodput and _meets(goodput, out.ttft, tpot, out.latency):
            good += 1
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    stats = {name: summarize(series[name], percentiles) for name in selected_metrics}
    return BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=completed / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        request_goodput=good / duration_s if goodput else None,
        stats=stats,
    )


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
    """Mean, median, std and percentiles (ms) of values in seconds; all 0 when empty."""
    if not values_s:
        return MetricStats(0.0, 0.0, 0.0, [(float(p), 0.0) for p in percentiles])
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return MetricStats(
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        std=float(ms.std()),
        percentiles=[(float(p), float(np.percentile(ms, p))) for p in percentiles],
    )


def format_report(metrics: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """The human-readable result block printed after a run."""
    rows = [
        ("Successful requests:", f"{metrics.completed}"),
        ("Failed requests:", f"{metrics.failed}"),
        ("Benchmark duration (s):", f"{metrics.duration_s:.2f}"),
        ("Total input tokens:", f"{metrics.total_input_tokens}"),
        ("Total generated tokens:", f"{metrics.total_output_tokens}"),
        ("Request throughput (req/s):", f"{metrics.request_throughput:.2f}"),
    ]
    if metrics.request_goodput is not None:
        rows.append(("Request goodput (req/s):", f"{metrics.request_goodput:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{metrics.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{metrics.total_token_throughput:.2f}"),
    ]
    lines = [f"{' ' + title + ' ':=^60}"]
    lines += [f"{k:<42}{v:>18}" for k, v in rows]
    for name, s in metrics.stats.items():
        lines.append(f"{' ' + METRIC_NAMES[name] + ' ':-^60}")
        lines.append(f"{f'Mean {name.upper()} (ms):':<42}{s.mean:>18.2f}")
        lines.append(f"{f'Median {name.upper()} (ms):':<42}{s.median:>18.2f}")
        for p, value in s.percentiles:
            lines.append(f"{f'P{_pct_label(p)} {name.upper()} (ms):':<42}{value:>18.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def _meets(slos: dict[str, float], ttft: float, tpot: float | None, e2el: float) -> bool:
    measured = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    for name, bound_ms in slos.items():
        value = measured[name]
        # A one-token request has no TPOT; it cannot violate a TPOT bound.
        if value is not None and value * 1000.0 > bound_ms:
            return False
    return True


def _pct_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)
