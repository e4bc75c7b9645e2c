"""Tests for benchmarks/gpu_check.sh and its table (benchmarks/gpu_check_table.py): the
mechanics on a CPU, the table from what each step leaves, and results kept when a step is
stopped by its time cap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm.benchmarks.serve as serve
import vllm.benchmarks.sweep as sweep
from tests.benchmarks.scripts import REPO, load_script
from vllm.benchmarks.sweep import PRESETS, ServedModel
from vllm.benchmarks.sweep_results import Cell, SweepResult, ratio_label

gpu_check_table = load_script("gpu_check_table")


def _cell(req_s: float, correct: float | None = None) -> Cell:
    return Cell(request_throughput=req_s, output_throughput=req_s * 128,
                mean_output_tokens=128.0, mean_ttft_ms=10.0, mean_tpot_ms=2.0,
                correct_rate=correct, failed=0)


def _write_results(result_dir: Path) -> None:
    (result_dir / "steps.tsv").write_text(
        "environment\t0\t4\ncuda_tests\t0\t95\nbench_decode\t0\t80\nsweep\t124\t230\n")
    (result_dir / "cuda_tests.log").write_text(
        "....\n========== 41 passed, 2 skipped in 93.20s (0:01:33) ==========\n")
    (result_dir / "decode.json").write_text(json.dumps(
        {"cuda-graphs": {"1": 300.0, "64": 9000.0}, "eager": {"1": 100.0, "64": 6000.0}}))
    # The sweep's own JSON, as run_sweep writes it.
    result = SweepResult("gpu", [0.0, 1.0])
    result.add("sync/uni", "0.0", _cell(10.0))
    result.add("sync/uni", "1.0", _cell(9.0, 1.0))
    result.add("async/uni", "0.0", _cell(12.5))
    result.add("async/uni", "1.0", _cell(11.7, 0.99))
    result.errors["async/mp"] = "server exited\nlast line"
    (result_dir / "profile").mkdir()
    step = {"wall_ms": 5.0, "busy_ms": 2.5, "syncs": 1, "eager_launches": 12,
            "graph_replays": 2}
    (result_dir / "profile" / "profile.json").write_text(json.dumps({"runs": [
        {"name": "decode-b1", "steps": [step, dict(step, wall_ms=7.0), dict(step, wall_ms=6.0)]},
        {"name": "json-b64", "steps": []}]}))
    (result_dir / "sweep").mkdir()
    (result_dir / "sweep" / "sweep.json").write_text(json.dumps(result.to_dict()))


def test_the_table_shows_every_step_and_its_numbers(tmp_path: Path) -> None:
    _write_results(tmp_path)
    table = gpu_check_table.table(tmp_path)
    lines = table.splitlines()
    assert lines[0] == "| check | setting | result |"
    assert "| environment | python, torch, CUDA | ok, 4 s |" in lines
    assert "| CUDA tests | pytest | ok, 95 s: 41 passed, 2 skipped |" in lines
    assert "| attention kernels | bench_attention.py | skipped |" in lines
    assert "| decode tok/s | batch 1 | graphs 300.0 / eager 100.0 = 3.00x |" in lines
    assert "| decode tok/s | batch 64 | graphs 9000.0 / eager 6000.0 = 1.50x |" in lines
    assert ("| step profile | decode-b1 | wall 6.00 ms, device busy 2.50 ms, 1 syncs, 12 eager "
            "launches, 2 graph replays per step |" in lines)
    assert "| step profile | json-b64 | no decode step recorded |" in lines
    assert "| sweep | sync/uni, 0% structured | 10.00 req/s, 1280 tok/s |" in lines
    assert ("| sweep | async/uni, 0% structured | 12.50 req/s (1.25x sync/uni), 1600 tok/s |"
            in lines)
    assert ("| sweep | async/uni, 100% structured | 11.70 req/s (1.30x sync/uni), 1498 tok/s, "
            "99% correct |" in lines)
    assert "| sweep | async/mp | FAILED: server exited |" in lines
    assert lines[-1] == "| total | all steps | 409 s |"


def test_missing_and_broken_results_do_not_break_the_table(tmp_path: Path) -> None:
    (tmp_path / "steps.tsv").write_text("environment\t0\t3\nbench_decode\t124\t110\n")
    (tmp_path / "decode.json").write_text("{not json")
    table = gpu_check_table.table(tmp_path)
    assert "| CUDA tests | pytest | skipped |" in table
    assert "| decode tok/s | graphs / eager | FAILED (exit 124), 110 s: no result |" in table
    assert "| sweep | req/s | skipped |" in table
    assert "| step profile | gpu_profile.py | skipped |" in table
    assert gpu_check_table.main([]) == 2


def test_a_sweep_stopped_midway_keeps_the_configurations_it_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu_check.sh caps the sweep's time: sweep.json must hold every configuration that
    finished before the cap, not appear only at the end."""

    class Stopped(BaseException):
        """What a time limit's signal does to the sweep: nothing after it runs."""

    def run_config(preset, model, tokenizer, config, ratios, num_prompts, extra_serve_args,
                   result_dir, result, log, round_) -> None:
        if config == "async/uni":
            raise Stopped
        for ratio in ratios:
            result.add(config, ratio_label(ratio), _cell(5.0))

    monkeypatch.setattr(sweep, "_run_config", run_config)
    monkeypatch.setattr(sweep, "prepare_model", lambda preset, workdir: ServedModel("m", "m", "t"))
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: None)
    with pytest.raises(Stopped):
        sweep.run_sweep(PRESETS["cpu-overhead"], tmp_path, ["sync/uni", "async/uni"],
                        [0.0, 1.0], repeats=1, log=lambda line: None)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert set(saved["cells"]) == {"sync/uni"}
    assert set(saved["cells"]["sync/uni"]) == {"0.0", "1.0"}


def test_quick_mode_runs_its_steps_and_prints_the_table_on_a_cpu(tmp_path: Path) -> None:
    """The script's mechanics without CUDA: mode, step bookkeeping and the final table
    (the heavy steps are skipped; the environment check still runs)."""
    # No wheels: a developer's .whl (made for the GPU machine's Python) must not matter here.
    env = dict(os.environ, PYTHON=sys.executable, ALLOW_CPU="1", SKIP_TESTS="1",
               SKIP_BENCH_DECODE="1", SKIP_PROFILE="1", SKIP_SWEEP="1",
               WHEEL_DIR=str(tmp_path / "no-wheels"))
    result_dir = tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(result_dir)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mode: quick" in done.stdout
    table = (result_dir / "table.md").read_text()
    assert "| environment | python, torch, CUDA | ok, " in table
    assert "| CUDA tests | pytest | skipped |" in table
    assert table in done.stdout
    bad = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--fast"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--fast" in bad.stderr


def test_a_capped_sweep_keeps_the_cells_of_the_configuration_it_was_measuring(
    monkeypatch, tmp_path: Path
) -> None:
    """A time cap kills the sweep mid-configuration (the GPU run lost async/mp's first two
    ratios this way): every measured cell must already be in sweep.json."""
    from vllm.benchmarks import structured_output

    class Stopped(BaseException):
        """What a time limit's signal does to the sweep: nothing after it runs."""

    record = {"completed": 4, "request_throughput": 7.0, "output_throughput": 900.0,
              "total_output_tokens": 512, "correctness": {"correct_rate": None}, "failed": 0}
    runs = iter([record, record, Stopped])  # warm-up, ratio 0.0, then the cap

    def run(args, tokenizer, quiet=False):
        item = next(runs)
        if item is Stopped:
            raise Stopped
        return item

    monkeypatch.setattr(structured_output, "run", run)
    monkeypatch.setattr(sweep.Server, "start", lambda self, timeout_s: None)
    monkeypatch.setattr(sweep.Server, "stop", lambda self: 0)
    monkeypatch.setattr(sweep, "prepare_model", lambda preset, workdir: ServedModel("m", "m", "t"))
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: None)
    with pytest.raises(Stopped):
        sweep.run_sweep(PRESETS["cpu-overhead"], tmp_path, ["async/mp"], [0.0, 1.0],
                        repeats=1, log=lambda line: None)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert set(saved["cells"]["async/mp"]) == {"0.0"}
