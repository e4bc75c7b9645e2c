"""Tests for benchmarks/bench_images.py's workload (the benchmark itself runs an engine; the
README and the closing notes give its command)."""

from __future__ import annotations

import numpy as np

from tests.benchmarks.scripts import load_script

bench_images = load_script("bench_images")


def test_every_request_has_its_own_image_and_one_placeholder() -> None:
    batch = bench_images.requests(4, 32, seed=0)
    pixels = [np.asarray(r["multi_modal_data"]["image"]) for r in batch]
    assert all(p.shape == (32, 32, 3) for p in pixels)
    assert len({p.tobytes() for p in pixels}) == 4  # distinct: each is encoded
    assert all(r["prompt"].count(bench_images.PLACEHOLDER) == 1 for r in batch)
