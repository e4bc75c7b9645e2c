"""Grouped bar charts as PNG files, drawn by matplotlib (the `bench` extra).

Only chart writers import this module; `import vllm` never loads matplotlib.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# Figure size in inches and resolution: the PNG is 960 x 540 pixels.
FIGSIZE = (8.0, 4.5)
DPI = 120


def _start(
    path: str | Path, series: dict[str, Sequence[float]], n: int, what: str
) -> tuple[Path, Figure, Any]:
    """Checks that each series has `n` values (ValueError naming it), creates the parent
    folder, and returns (path, figure, axes)."""
    for name, values in series.items():
        if len(values) != n:
            raise ValueError(f"series: {name!r} has {len(values)} values for {n} {what}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A Figure on an explicit Agg canvas: no display needed, and unlike pyplot no process-wide
    # backend or figure registry is touched.
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    return path, fig, fig.add_subplot()


def bar_chart_png(
    path: str | Path,
    title: str,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    ylabel: str = "",
) -> Path:
    """Write a grouped bar chart: one group per label in `groups`, one bar per series, bar k in
    matplotlib's color cycle entry "C{k % 10}". Returns the path.

    Raises ValueError if a series does not have one value per group, OSError if the file cannot
    be written.
    """
    path, fig, ax = _start(path, series, len(groups), "groups")
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        offset = (k - (len(series) - 1) / 2) * width
        xs = [i + offset for i in range(len(groups))]
        bars = ax.bar(xs, list(values), width, label=name, color=f"C{k % 10}")
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.margins(y=0.12)
    if series:
        # Below the axes, so the legend never hides a bar.
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=len(series))
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def line_chart_png(
    path: str | Path,
    title: str,
    xs: Sequence[float],
    series: dict[str, Sequence[float]],
    xlabel: str = "",
    ylabel: str = "",
    log_x: bool = False,
) -> Path:
    """Write a line chart with markers: one line per series over the shared `xs`, line k in
    color "C{k % 10}". Returns the path.

    Raises ValueError if a series does not have one value per x, OSError if the file cannot
    be written.
    """
    path, fig, ax = _start(path, series, len(xs), "points")
    for k, (name, values) in enumerate(series.items()):
        ax.plot(list(xs), list(values), marker="o", label=name, color=f"C{k % 10}")
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
