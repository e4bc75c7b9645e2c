"""benchmarks/gpu_profile.py and bench_triton_launch.py: the step analysis on a synthetic
CUDA trace (exact counts), the whole profile's mechanics on the CPU, and the Triton launch
timer under the interpreter."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmarks.scripts import load_script

load_script("bench_offline")  # gpu_profile imports its siblings by name
triton_launch = load_script("bench_triton_launch")
gpu_profile = load_script("gpu_profile")


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_analysis_of_a_cuda_trace_counts_each_steps_work() -> None:
    """Two steps: the first replays a graph of two kernels, launches one kernel itself,
    synchronises once and copies to the host once; the device idles 100 us while the host
    runs the scheduler. The second step has one eager kernel."""
    events = [
        _x("user_annotation", "decode step 3: execute", 0, 50),
        _x("user_annotation", "decode step 3: sample", 60, 20),
        _x("user_annotation", "decode step 4: execute", 1000, 50),
        _x("cuda_runtime", "cudaGraphLaunch", 10, 5, correlation=7),
        _x("kernel", "gemm", 20, 300, tid=9, correlation=7),
        _x("kernel", "norm", 320, 80, tid=9, correlation=7),
        _x("cuda_runtime", "cudaLaunchKernel", 60, 5, correlation=8),
        _x("kernel", "argmax", 400, 100, tid=9, correlation=8),
        _x("cuda_runtime", "cudaStreamSynchronize", 70, 10),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 500, 20, tid=9),
        _x("python_function", "vllm/v1/core/sched/scheduler.py(10): schedule", 550, 300,
           **{"Python id": 1, "Python parent id": None}),
        _x("python_function", "vllm/v1/core/sched/scheduler.py(90): _pick", 600, 200,
           **{"Python id": 2, "Python parent id": 1}),
        _x("kernel", "late", 900, 80, tid=9, correlation=9),
        _x("cuda_runtime", "cudaLaunchKernel_v7000", 1010, 5, correlation=10),  # versioned
        _x("kernel", "argmax", 1020, 30, tid=9, correlation=10),
    ]
    run = gpu_profile.analyze({"traceEvents": events}, cuda=True, gap_us=50)
    first, second = run.steps
    assert (first.step, first.wall_ms) == (3, 1.0)
    assert first.busy_ms == 0.58  # 20..520 (graph, kernel, copy) and 900..980
    assert first.graph_replays == 1 and first.graph_kernels == 2
    assert first.eager_launches == 1 and first.syncs == 1 and first.d2h_copies == 1
    assert first.num_gaps == 1  # 520..900; 0..20 and 980..1000 are under 50 us
    assert first.largest_gaps == [(0.38, "[1] vllm/v1/core/sched/scheduler.py(90): _pick")]
    assert second.graph_replays == 0 and second.eager_launches == 1 and second.syncs == 0
    names = dict(run.host_functions)
    assert names["vllm/v1/core/sched/scheduler.py(90): _pick"] == 0.2
    assert names["vllm/v1/core/sched/scheduler.py(10): schedule"] == 0.1  # own time only


def test_cpu_mode_profiles_every_run(tmp_path: Path, capsys) -> None:
    assert gpu_profile.main(["--cpu", "--batch-sizes", "3", "--steps", "2", "--json-batch",
                             "0", "--edits-batch", "2", "--out-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "profile.json").read_text())
    assert [r["name"] for r in summary["runs"]] == ["edits-b2", "decode-b3"]
    for run in summary["runs"]:
        assert [s["step"] for s in run["steps"]] == [3, 4]
        assert all(0 < s["busy_ms"] <= s["wall_ms"] for s in run["steps"])
        assert all(s["eager_launches"] > 0 and s["graph_replays"] == 0 for s in run["steps"])
        assert run["host_functions"]
        assert json.loads(Path(run["trace"]).read_text())["traceEvents"]
    out = capsys.readouterr().out
    assert "== decode-b3: batch 3" in out and "step   4: wall" in out


def test_triton_launch_timer_mechanics() -> None:
    """Under the interpreter (no CUDA here) the numbers mean nothing; the calls must run."""
    rows = triton_launch.measure(iters=1, warmup=0,
                                 only={"torch add_ (baseline)", "reshape_and_cache"})
    assert [r["kernel"] for r in rows] == ["torch add_ (baseline)", "reshape_and_cache"]
    assert all(r["host_us"] > 0 and r["wall_us"] >= r["host_us"] for r in rows)
