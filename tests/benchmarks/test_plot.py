"""Tests for vllm/benchmarks/plot.py: the PNG is well formed and bars scale with values."""

from __future__ import annotations

import builtins
import struct
import zlib
from pathlib import Path

import pytest

from vllm.benchmarks.plot import PALETTE, bar_chart_png, write_png


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB, filter-0 PNG (what write_png emits) into rows."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(tag + body)
        if tag == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif tag == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = 1 + width * 3
    rows = [raw[i * stride + 1 : (i + 1) * stride] for i in range(height)]
    assert all(raw[i * stride] == 0 for i in range(height))
    return width, height, rows


def count_color(rows: list[bytes], rgb: tuple[int, int, int]) -> int:
    target = bytes(rgb)
    return sum(
        1 for row in rows for x in range(0, len(row), 3) if row[x : x + 3] == target
    )


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.__import__

    def fake(name: str, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)


def test_write_png_roundtrip(tmp_path: Path) -> None:
    rows = [bytearray(bytes([r, g, 7]) * 3) for r, g in [(1, 2), (3, 4)]]
    write_png(tmp_path / "p.png", rows, 3)
    width, height, decoded = read_png(tmp_path / "p.png")
    assert (width, height) == (3, 2)
    assert decoded == [bytes(r) for r in rows]


def test_fallback_bars_scale_with_values(tmp_path: Path, no_matplotlib: None) -> None:
    path = bar_chart_png(tmp_path / "c.png", "throughput", ["0.0", "1.0"],
                         {"a": [10.0, 20.0], "b": [40.0, 40.0]})
    width, height, rows = read_png(path)
    assert (width, height) == (960, 540)
    a, b = count_color(rows, PALETTE[0]), count_color(rows, PALETTE[1])
    # Legend swatches are 14x14 pixels of each color; bars are proportional to the values.
    swatch = 14 * 14
    assert (b - swatch) / (a - swatch) == pytest.approx(80.0 / 30.0, rel=0.03)


def test_matplotlib_or_fallback_writes_png(tmp_path: Path) -> None:
    path = bar_chart_png(tmp_path / "m.png", "t", ["x"], {"s": [1.0]}, ylabel="req/s")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mismatched_series_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="series"):
        bar_chart_png(tmp_path / "x.png", "t", ["a", "b"], {"s": [1.0]})
