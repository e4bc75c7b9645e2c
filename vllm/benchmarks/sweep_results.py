"""A sweep's results and their report: cells (one per configuration and ratio, the median of
its repeats), the headline ratios, the noise-aware comparisons, the tables and the chart."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Cell:
    """One (configuration, ratio) measurement."""

    request_throughput: float
    output_throughput: float
    mean_output_tokens: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    correct_rate: float | None
    failed: int


def median_cell(samples: Sequence[Cell]) -> Cell:
    """One cell of the per-field medians of `samples` (failures summed). Raises ValueError
    for no samples."""
    if not samples:
        raise ValueError("median_cell: no samples")

    def median(name: str) -> Any:
        values = [getattr(c, name) for c in samples if getattr(c, name) is not None]
        return statistics.median(values) if values else None

    return Cell(
        request_throughput=median("request_throughput"),
        output_throughput=median("output_throughput"),
        mean_output_tokens=median("mean_output_tokens"),
        mean_ttft_ms=median("mean_ttft_ms"),
        mean_tpot_ms=median("mean_tpot_ms"),
        correct_rate=median("correct_rate"),
        failed=sum(c.failed for c in samples),
    )


@dataclass
class SweepResult:
    """All cells of a sweep, keyed by configuration then ratio label ("0.2"): `samples` holds
    every repeat, `cells` their medians."""

    preset: str
    ratios: list[float]
    cells: dict[str, dict[str, Cell]] = field(default_factory=dict)
    samples: dict[str, dict[str, list[Cell]]] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    # Configurations that failed, with why.
    errors: dict[str, str] = field(default_factory=dict)

    def add(self, config: str, label: str, cell: Cell) -> None:
        """Records one repeat of a cell and updates the cell's medians."""
        samples = self.samples.setdefault(config, {}).setdefault(label, [])
        samples.append(cell)
        self.cells.setdefault(config, {})[label] = median_cell(samples)

    def spread(self, config: str, label: str,
               attr: str = "request_throughput") -> tuple[float, float] | None:
        """(min, max) of `attr` over the repeats of a cell; None when it has none."""
        values = [getattr(c, attr) for c in self.samples.get(config, {}).get(label, [])]
        return (min(values), max(values)) if values else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the headline ratios included."""
        out = asdict(self)
        out["headlines"] = headlines(self)
        return out


def ratio_label(ratio: float) -> str:
    """"0.0", "0.2", "1.0": the column name of a ratio."""
    return f"{ratio:.1f}"


def headlines(result: SweepResult) -> dict[str, Any]:
    """The two headline ratios (None where a needed cell is missing):

    - async_speedup: async/uni ÷ sync/uni request throughput at ratio 0.0 (target ≥ 1.3);
    - structured_retention: ratio 1.0 ÷ ratio 0.0 for the best configuration, the one with the
      highest mean request throughput over the ratios (target ≥ 0.9); also in output tokens/s.
    """
    cells = result.cells

    def get(config: str, ratio: str, attr: str = "request_throughput") -> float | None:
        cell = cells.get(config, {}).get(ratio)
        return getattr(cell, attr) if cell is not None else None

    sync0, async0 = get("sync/uni", "0.0"), get("async/uni", "0.0")
    speedup = async0 / sync0 if sync0 and async0 is not None else None
    noise = within_noise(result, "async/uni", "sync/uni", "0.0")
    measured = {c: row for c, row in cells.items() if row}
    best = max(
        measured,
        key=lambda c: sum(x.request_throughput for x in measured[c].values()) / len(measured[c]),
        default=None,
    )
    retention = retention_tok = None
    if best is not None:
        r0, r1 = get(best, "0.0"), get(best, "1.0")
        t0, t1 = get(best, "0.0", "output_throughput"), get(best, "1.0", "output_throughput")
        retention = r1 / r0 if r0 and r1 is not None else None
        retention_tok = t1 / t0 if t0 and t1 is not None else None
    return {
        "async_speedup_at_0": speedup,
        "async_speedup_at_0_within_noise": noise,
        "best_config": best,
        "structured_retention_best": retention,
        "structured_retention_best_tokens": retention_tok,
    }


def within_noise(result: SweepResult, a: str, b: str, label: str) -> bool | None:
    """True when the request-throughput ranges (min–max over the repeats) of two cells
    overlap, so their difference is not established; None when a cell is missing."""
    sa, sb = result.spread(a, label), result.spread(b, label)
    if sa is None or sb is None:
        return None
    return sa[0] <= sb[1] and sb[0] <= sa[1]


def comparisons(result: SweepResult, baseline: str = "sync/uni") -> list[str]:
    """One line per (configuration, ratio): its median request throughput ÷ the baseline's,
    the ratio's range over the repeats, and whether it is within noise."""
    lines = []
    for config, row in result.cells.items():
        if config == baseline:
            continue
        for label in [ratio_label(r) for r in result.ratios]:
            base = result.cells.get(baseline, {}).get(label)
            cell, sa, sb = row.get(label), result.spread(config, label), result.spread(
                baseline, label)
            if cell is None or base is None or not base.request_throughput or not sa or not sb:
                continue
            verdict = "within noise" if within_noise(result, config, baseline, label) else (
                "faster" if cell.request_throughput > base.request_throughput else "slower")
            lines.append(
                f"  {config} ÷ {baseline} at {label}: "
                f"{cell.request_throughput / base.request_throughput:.2f}× "
                f"(range {sa[0] / sb[1]:.2f}–{sa[1] / sb[0]:.2f}), {verdict}"
            )
    return lines


def format_tables(result: SweepResult) -> str:
    """Markdown tables (request throughput, output tokens/s, tokens per request, correctness)
    and the headline ratios."""
    labels = [ratio_label(r) for r in result.ratios]
    blocks = []
    for title, attr, fmt in (
        ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
        ("Output token throughput (tok/s)", "output_throughput", "{:.1f}"),
        ("Mean output tokens per request", "mean_output_tokens", "{:.1f}"),
        ("Correct structured outputs", "correct_rate", None),
    ):
        lines = [f"{title}, preset {result.preset}:", ""]
        lines.append("| config | " + " | ".join(labels) + " |")
        lines.append("|---|" + "---|" * len(labels))
        for config, row in result.cells.items():
            values = []
            for label in labels:
                cell = row.get(label)
                spread = result.spread(config, label, attr) if fmt is not None else None
                if cell is None:
                    values.append("-")
                elif fmt is None:
                    values.append(percent(cell.correct_rate))
                elif spread is not None and spread[0] != spread[1]:
                    low, high = (fmt.format(v) for v in spread)
                    values.append(f"{fmt.format(getattr(cell, attr))} ({low}–{high})")
                else:
                    values.append(fmt.format(getattr(cell, attr)))
            lines.append(f"| {config} | " + " | ".join(values) + " |")
        blocks.append("\n".join(lines))
    repeats = max((len(v) for row in result.samples.values() for v in row.values()), default=1)
    if repeats > 1:
        blocks[0] = blocks[0].replace(
            "Request throughput (req/s)",
            f"Request throughput (req/s), median (min–max) of {repeats} interleaved repeats", 1)
    compared = comparisons(result)
    if compared:
        blocks.append("Against sync/uni (request throughput; within noise when the "
                      "min–max ranges overlap):\n" + "\n".join(compared))
    h = headlines(result)
    blocks.append(
        "Headline ratios:\n"
        f"  async/uni ÷ sync/uni at 0.0 (request throughput): {_ratio(h['async_speedup_at_0'])}"
        f"{' (within noise)' if h['async_speedup_at_0_within_noise'] else ''}"
        "  (target ≥ 1.30)\n"
        f"  1.0 ÷ 0.0 for the best config ({h['best_config']}): "
        f"{_ratio(h['structured_retention_best'])} in req/s, "
        f"{_ratio(h['structured_retention_best_tokens'])} in output tok/s  (target ≥ 0.90)"
    )
    if result.errors:
        blocks.append("Failed configurations:\n" + "\n".join(
            f"  {config}: {first_and_last_line(why)}" for config, why in result.errors.items()
        ))
    return "\n\n".join(blocks)


def write_chart(result: SweepResult, path: Path) -> Path:
    """A grouped bar chart of request throughput: groups = ratios, bars = configurations."""
    from vllm.benchmarks.plot import bar_chart_png

    labels = [ratio_label(r) for r in result.ratios]
    series = {
        config: [row[label].request_throughput if label in row else 0.0 for label in labels]
        for config, row in result.cells.items()
    }
    title = f"request throughput by structured-output ratio ({result.preset})"
    return bar_chart_png(path, title, labels, series, ylabel="requests/s")


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def first_and_last_line(text: str) -> str:
    """A failure's text in one line: its first and last non-blank lines (a traceback's
    header and its error)."""
    lines = [line for line in text.strip().splitlines() if line.strip()] or ["?"]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1].strip()}"
