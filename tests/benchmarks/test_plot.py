"""Tests for vllm/benchmarks/plot.py: a 960x540 PNG whose bars have the heights of the data."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from vllm.benchmarks.plot import bar_chart_png, line_chart_png

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_rgb(path: Path) -> np.ndarray:
    """The PNG as an (height, width, 3) uint8 array."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    return np.round(image[..., :3] * 255).astype(np.uint8)


def rectangles(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(left, top, bottom) of each solid rectangle in a boolean mask, left to right."""
    found, open_since = [], {}  # (top, bottom) of a vertical run -> first column holding it
    for x in range(mask.shape[1] + 1):
        runs = set()
        if x < mask.shape[1]:
            rows = np.flatnonzero(mask[:, x])
            for run in np.split(rows, np.flatnonzero(np.diff(rows) > 1) + 1) if rows.size else []:
                runs.add((int(run[0]), int(run[-1])))
        for key in [k for k in open_since if k not in runs]:
            found.append((open_since.pop(key), *key))
        for key in runs:
            open_since.setdefault(key, x)
    return sorted(found)


def bar_heights(image: np.ndarray, color: str) -> list[int]:
    """Heights in pixels, left to right, of the bars drawn in `color`.

    The legend swatch of the color sits below the axes; bars are the rectangles standing on
    the axes' baseline, the highest bottom edge of any rectangle.
    """
    rgb = np.round(np.array(to_rgb(color)) * 255).astype(np.uint8)
    rects = rectangles(np.all(image == rgb, axis=-1))
    baseline = min(bottom for _, _, bottom in rects)
    return [bottom - top + 1 for _, top, bottom in rects if bottom <= baseline + 1]


def test_bars_have_the_heights_of_the_values(tmp_path: Path) -> None:
    path = bar_chart_png(tmp_path / "c.png", "throughput", ["0.0", "1.0"],
                         {"a": [10.0, 20.0], "b": [40.0, 40.0]}, ylabel="req/s")
    image = read_rgb(path)
    assert image.shape == (540, 960, 3)
    a, b = bar_heights(image, "C0"), bar_heights(image, "C1")
    assert len(a) == 2 and len(b) == 2
    assert a[0] > 40  # big enough for the pixel tolerance below to mean something
    # Anti-aliased edges are not the exact color: allow two pixels.
    assert a[1] == pytest.approx(2 * a[0], abs=2)
    assert b[0] == pytest.approx(b[1], abs=1)
    assert b[0] == pytest.approx(4 * a[0], abs=3)


def test_one_series_per_color(tmp_path: Path) -> None:
    series = {"x": [1.0, 2.0, 3.0], "y": [3.0, 2.0, 1.0], "z": [2.0, 2.0, 2.0]}
    image = read_rgb(bar_chart_png(tmp_path / "s.png", "t", ["p", "q", "r"], series))
    heights = [bar_heights(image, f"C{k}") for k in range(3)]
    assert [len(h) for h in heights] == [3, 3, 3]
    x, y, z = heights
    assert x[0] < x[1] < x[2] and y[0] > y[1] > y[2]
    assert max(z) - min(z) <= 1 and x[1] == pytest.approx(z[0], abs=1)


def test_no_series_draws_empty_axes_without_warnings(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = bar_chart_png(tmp_path / "sub" / "e.png", "nothing ran", ["0.0"], {})
    assert read_rgb(path).shape == (540, 960, 3)


def test_mismatched_series_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="series"):
        bar_chart_png(tmp_path / "x.png", "t", ["a", "b"], {"s": [1.0]})
    assert not (tmp_path / "x.png").exists()


def test_line_chart_draws_one_colored_line_per_series(tmp_path: Path) -> None:
    path = line_chart_png(tmp_path / "l.png", "t", [1, 4, 16],
                          {"up": [1.0, 2.0, 3.0], "flat": [2.0, 2.0, 2.0]},
                          xlabel="batch", ylabel="tok/s", log_x=True)
    image = read_rgb(path)
    assert image.shape == (540, 960, 3)
    for color in ("C0", "C1"):
        rgb = (np.array(to_rgb(color)) * 255).round()
        assert (np.abs(image.astype(int) - rgb).sum(axis=2) < 30).sum() > 100, color
    with pytest.raises(ValueError, match="series"):
        line_chart_png(tmp_path / "x.png", "t", [1, 2], {"s": [1.0]})


def test_no_matplotlib_at_vllm_import_and_no_pyplot_state(tmp_path: Path) -> None:
    code = (
        "import sys, vllm, vllm.benchmarks.sweep\n"
        "assert 'matplotlib' not in sys.modules, 'import vllm loaded matplotlib'\n"
        "from vllm.benchmarks.plot import bar_chart_png\n"
        f"bar_chart_png({str(tmp_path / 'p.png')!r}, 't', ['a'], {{'s': [1.0]}})\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'chart went through pyplot'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_SIGNATURE
