"""Tests for benchmarks/bench_lora.py: the adapters it writes are what the cells claim (the
ranks, one distinct adapter per slot used), and one tiny run fills every cell."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.benchmarks.scripts import load_script
from vllm.model_executor.model_loader.demo_model import build_demo_model

bench_lora = load_script("bench_lora")


def test_assign_cycles_through_the_distinct_adapters() -> None:
    adapters = ["a", "b", "c", "d"]
    assert bench_lora.assign(adapters, 0, 3) == [None, None, None]
    assert bench_lora.assign(adapters, 1, 3) == ["a", "a", "a"]
    assert bench_lora.assign(adapters, 4, 6) == ["a", "b", "c", "d", "a", "b"]


@pytest.mark.slow
def test_a_tiny_run_fills_every_cell(tmp_path) -> None:
    model_dir = build_demo_model("demo-tiny")
    paths = bench_lora.write_adapters(model_dir, tmp_path, rank=2, count=4)
    for path in paths:
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["r"] == 2 and set(config["target_modules"]) == set(bench_lora.TARGETS)
    args = argparse.Namespace(num_prompts=4, output_len=2, repeats=2)
    runs = bench_lora.run_rank(str(model_dir), 2, paths, args)
    assert set(runs) == set(bench_lora.ADAPTERS)
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in runs.values())
