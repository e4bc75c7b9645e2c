"""Grouped bar charts as PNG: matplotlib when installed, else a small built-in rasterizer.

The fallback keeps benchmark machines without matplotlib (e.g. offline GPU hosts) able to
write a chart; it draws bars, axes, value labels and a legend in a 3x5 pixel font.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

# Bar colors (RGB), one per series.
PALETTE = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189))

# 3x5 glyphs, rows top to bottom, "#" = ink. Upper case is drawn as lower case.
_FONT = {
    "0": "###|#.#|#.#|#.#|###", "1": ".#.|##.|.#.|.#.|###", "2": "###|..#|###|#..|###",
    "3": "###|..#|.##|..#|###", "4": "#.#|#.#|###|..#|..#", "5": "###|#..|###|..#|###",
    "6": "###|#..|###|#.#|###", "7": "###|..#|.#.|.#.|.#.", "8": "###|#.#|###|#.#|###",
    "9": "###|#.#|###|..#|###", "a": ".#.|#.#|###|#.#|#.#", "b": "##.|#.#|##.|#.#|##.",
    "c": ".##|#..|#..|#..|.##", "d": "##.|#.#|#.#|#.#|##.", "e": "###|#..|##.|#..|###",
    "f": "###|#..|##.|#..|#..", "g": ".##|#..|#.#|#.#|.##", "h": "#.#|#.#|###|#.#|#.#",
    "i": "###|.#.|.#.|.#.|###", "j": "..#|..#|..#|#.#|.#.", "k": "#.#|#.#|##.|#.#|#.#",
    "l": "#..|#..|#..|#..|###", "m": "#.#|###|###|#.#|#.#", "n": "##.|#.#|#.#|#.#|#.#",
    "o": ".#.|#.#|#.#|#.#|.#.", "p": "##.|#.#|##.|#..|#..", "q": ".#.|#.#|#.#|##.|.##",
    "r": "##.|#.#|##.|#.#|#.#", "s": ".##|#..|.#.|..#|##.", "t": "###|.#.|.#.|.#.|.#.",
    "u": "#.#|#.#|#.#|#.#|###", "v": "#.#|#.#|#.#|#.#|.#.", "w": "#.#|#.#|###|###|#.#",
    "x": "#.#|#.#|.#.|#.#|#.#", "y": "#.#|#.#|.#.|.#.|.#.", "z": "###|..#|.#.|#..|###",
    ".": "...|...|...|...|.#.", "/": "..#|..#|.#.|#..|#..", "-": "...|...|###|...|...",
    ":": "...|.#.|...|.#.|...", "(": ".#.|#..|#..|#..|.#.", ")": ".#.|..#|..#|..#|.#.",
    "=": "...|###|...|###|...", "%": "#.#|..#|.#.|#..|#.#", "_": "...|...|...|...|###",
    ",": "...|...|...|.#.|#..", "+": "...|.#.|###|.#.|...", " ": "...|...|...|...|...",
}


def bar_chart_png(
    path: str | Path,
    title: str,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    ylabel: str = "",
) -> Path:
    """Write a grouped bar chart: one group per label in `groups`, one bar per series.

    Uses matplotlib if it can be imported, else the built-in rasterizer. Raises ValueError if
    a series does not have one value per group, OSError if the file cannot be written.
    """
    for name, values in series.items():
        if len(values) != len(groups):
            raise ValueError(f"series: {name!r} has {len(values)} values for {len(groups)} groups")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _raster_chart(path, title, groups, series)
        return path
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name, color=[c / 255 for c in PALETTE[k % 5]])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.margins(y=0.12)
    # Below the axes, so the legend never hides a bar.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=max(1, len(series)))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_png(path: Path, pixels: list[bytearray], width: int) -> None:
    """Write 8-bit RGB rows (each `width * 3` bytes) as a PNG file."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, len(pixels), 8, 2, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
    data += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(data)


class _Canvas:
    """An RGB pixel grid with rectangles and scaled 3x5 text."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(b"\xff" * (width * 3)) for _ in range(height)]

    def rect(self, x0: int, y0: int, x1: int, y1: int, rgb: tuple[int, int, int]) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        for y in range(y0, y1):
            self.rows[y][x0 * 3 : x1 * 3] = bytes(rgb) * (x1 - x0)

    def text(self, x: int, y: int, s: str, scale: int = 2, center: bool = False) -> None:
        if center:
            x -= len(s) * 4 * scale // 2
        for ch in s.lower():
            glyph = _FONT.get(ch, _FONT[" "])
            for r, line in enumerate(glyph.split("|")):
                for c, cell in enumerate(line):
                    if cell == "#":
                        px, py = x + c * scale, y + r * scale
                        self.rect(px, py, px + scale, py + scale, (0, 0, 0))
            x += 4 * scale


def _raster_chart(
    path: Path, title: str, groups: Sequence[str], series: dict[str, Sequence[float]]
) -> None:
    width, height = 960, 540
    left, right, top, bottom = 70, 20, 60, 70
    canvas = _Canvas(width, height)
    canvas.text(width // 2, 15, title, scale=3, center=True)
    peak = max([v for values in series.values() for v in values] + [1e-9])
    plot_h = height - top - bottom
    canvas.rect(left, top, left + 2, height - bottom, (0, 0, 0))
    canvas.rect(left, height - bottom, width - right, height - bottom + 2, (0, 0, 0))
    for frac in (0.0, 0.5, 1.0):
        y = height - bottom - int(frac * plot_h)
        canvas.text(5, y - 5, f"{frac * peak:.1f}")
    group_w = (width - left - right) / max(1, len(groups))
    bar_w = int(group_w * 0.8 / max(1, len(series)))
    for g, label in enumerate(groups):
        gx = left + g * group_w + group_w * 0.1
        for k, values in enumerate(series.values()):
            x0 = int(gx + k * bar_w)
            bar_h = int(values[g] / peak * plot_h)
            canvas.rect(x0 + 1, height - bottom - bar_h, x0 + bar_w - 1, height - bottom,
                        PALETTE[k % len(PALETTE)])
            canvas.text(x0 + bar_w // 2, height - bottom - bar_h - 14, f"{values[g]:.1f}",
                        scale=1, center=True)
        canvas.text(int(left + (g + 0.5) * group_w), height - bottom + 10, label, center=True)
    lx = left + 10
    for k, name in enumerate(series):
        canvas.rect(lx, height - 30, lx + 14, height - 16, PALETTE[k % len(PALETTE)])
        canvas.text(lx + 20, height - 28, name)
        lx += 20 + len(name) * 8 + 30
    write_png(path, canvas.rows, width)
