"""Tests for benchmarks/bench_layers.py: the bare loop's per-op instrumentation (the
benchmark itself loads the real model and takes minutes)."""

from __future__ import annotations

from tests.benchmarks.scripts import load_script
from tests.utils_models import build_checkpoint
from vllm.model_executor.greedy_decode_loop import BareDecoder

bench = load_script("bench_layers")


def test_the_bare_loop_reports_every_op_type_of_its_decode_steps(tmp_path) -> None:
    build_checkpoint("llama", tmp_path, seed=0)
    decoder = BareDecoder(tmp_path)
    timer, clock = bench.OpTimer(), bench.StepClock()
    bench.instrument_bare(decoder, timer, clock)
    row = bench.run_bare(decoder, [[5, 6, 7], [8, 9, 10]], 4, timer, clock)
    assert clock.decode_steps == 4 and clock.starts[0] is None  # the prefill, then decodes
    for op in bench.LAYER_OPS:
        assert row[op] > 0, op
    # The ops run inside the layer's timer: what is left is the layer's own glue.
    assert row["rest of layer"] >= 0
    assert row["forward (ms/step)"] > row["layers (ms/step)"] > 0  # layers run inside it


def test_a_step_is_timed_between_two_decode_passes_only() -> None:
    clock = bench.StepClock()
    clock.starts = [None, 1.0, 2.0, None, 10.0, 13.0]  # a prefill between decode runs
    assert clock.step_seconds() == 2.0 and clock.decode_steps == 4
