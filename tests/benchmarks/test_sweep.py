"""Tests for vllm/benchmarks/sweep.py: commands, server lifecycle, tables and headline ratios.

The sweep itself (real servers, minutes) is not run here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm.benchmarks import structured_output, sweep, sweep_results
from vllm.benchmarks.sweep import ServedModel
from vllm.benchmarks.sweep_results import Cell, SweepResult

REPO = Path(__file__).resolve().parents[2]


def cell(req: float, tok: float = 0.0) -> Cell:
    return Cell(req, tok, 100.0, 1.0, 2.0, 1.0, 0)


@pytest.fixture
def result() -> SweepResult:
    r = SweepResult("cpu-test", [0.0, 0.2, 0.8, 1.0])
    r.cells = {
        "sync/uni": {"0.0": cell(10, 1000), "0.2": cell(9), "0.8": cell(8), "1.0": cell(7, 600)},
        "async/uni": {"0.0": cell(14, 1400), "0.2": cell(13), "0.8": cell(12), "1.0": cell(12.6, 1300)},
        "async/mp": {"0.0": cell(13, 1300), "0.2": cell(12), "0.8": cell(11), "1.0": cell(10, 900)},
    }
    return r


def test_headlines(result: SweepResult) -> None:
    h = sweep_results.headlines(result)
    assert h["async_speedup_at_0"] == pytest.approx(1.4)
    assert h["best_config"] == "async/uni"  # highest mean over the ratios
    assert h["structured_retention_best"] == pytest.approx(0.9)
    assert h["structured_retention_best_tokens"] == pytest.approx(1300 / 1400)


def test_headlines_with_missing_cells() -> None:
    r = SweepResult("p", [0.0])
    assert sweep_results.headlines(r)["async_speedup_at_0"] is None
    r.cells = {"async/mp": {"0.0": cell(5)}}
    h = sweep_results.headlines(r)
    assert h["async_speedup_at_0"] is None and h["best_config"] == "async/mp"
    assert h["structured_retention_best"] is None


def test_tables(result: SweepResult) -> None:
    text = sweep_results.format_tables(result)
    assert "| config | 0.0 | 0.2 | 0.8 | 1.0 |" in text
    assert "| async/uni | 14.00 | 13.00 | 12.00 | 12.60 |" in text
    assert "| sync/uni | 1000.0 | 0.0 | 0.0 | 600.0 |" in text
    assert "| sync/uni | 100.0% | 100.0% | 100.0% | 100.0% |" in text
    assert "1.40×" in text and "(async/uni): 0.90× in req/s, 0.93× in output tok/s" in text
    d = result.to_dict()
    assert d["headlines"]["best_config"] == "async/uni"
    json.dumps(d)


def test_chart(result: SweepResult, tmp_path: Path) -> None:
    from matplotlib.image import imread

    path = sweep_results.write_chart(result, tmp_path / "s.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(path).shape[:2] == (540, 960)


def test_serve_commands() -> None:
    model = ServedModel("/m", "name", "/m")
    sync = sweep.serve_command(model, "sync/uni", 1234, ["--max-num-seqs", "8"])
    assert sync[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert "--async-scheduling" not in sync and "--no-async-scheduling" in sync
    assert sync[sync.index("--distributed-executor-backend") + 1] == "uni"
    assert sync[sync.index("--port") + 1] == "1234" and sync[-2:] == ["--max-num-seqs", "8"]
    mp = sweep.serve_command(model, "async/mp", 1, [])
    assert "--async-scheduling" in mp and "--no-async-scheduling" not in mp and mp[mp.index("--distributed-executor-backend") + 1] == "mp"
    sync_mp = sweep.serve_command(model, "sync/mp", 1, [])
    assert "--async-scheduling" not in sync_mp and "--no-async-scheduling" in sync_mp
    assert sync_mp[sync_mp.index("--distributed-executor-backend") + 1] == "mp"
    with pytest.raises(ValueError, match="config"):
        sweep.serve_command(model, "async/ray", 1)


def test_bench_argv_parses_with_the_benchmark_flags() -> None:
    parser = structured_output.add_cli_args(argparse.ArgumentParser())
    preset = sweep.PRESETS["gpu"]
    model = ServedModel("/d", "qwen3-1.7b", "/d")
    args = parser.parse_args(sweep.bench_argv(preset, model, 5555, 0.2, result_dir=Path("/r")))
    assert (args.port, args.model, args.tokenizer) == (5555, "qwen3-1.7b", "/d")
    assert (args.num_prompts, args.output_len, args.request_rate) == (4000, 128, 200.0)
    assert (args.max_concurrency, args.structured_output_ratio) == (800, 0.2)
    assert args.save_results and args.result_dir == "/r"
    structured_output.check_args(args)
    cpu = parser.parse_args(sweep.bench_argv(sweep.PRESETS["cpu-demo"], model, 1, 1.0, num_prompts=3, output_len=7))
    assert cpu.request_rate == float("inf") and (cpu.num_prompts, cpu.output_len) == (3, 7)


def test_presets_are_sane() -> None:
    assert set(sweep.PRESETS) == {"cpu-overhead", "cpu-demo", "gpu"}
    gpu = sweep.PRESETS["gpu"]
    assert (gpu.num_prompts, gpu.request_rate, gpu.max_concurrency, gpu.output_len) == (4000, 200.0, 800, 128)
    assert "--load-format" in gpu.serve_args
    for preset in sweep.PRESETS.values():
        assert "--structured-outputs-config.disable_any_whitespace" in preset.serve_args


def test_prepare_gpu_model_assembles_config_and_tokenizer(tmp_path: Path) -> None:
    model = sweep.prepare_model(sweep.PRESETS["gpu"], tmp_path)
    root = Path(model.serve_arg)
    assert root == tmp_path / "models" / "qwen3-1.7b" and model.served_name == "qwen3-1.7b"
    config = json.loads((root / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (2048, 28, 151936)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in root.iterdir()}


def test_prepare_unknown_model_names_the_shipped_configs(tmp_path: Path) -> None:
    preset = dataclasses.replace(sweep.PRESETS["gpu"], model="no-such-model")
    with pytest.raises(ValueError, match="preset.model: 'no-such-model' .*qwen3-1.7b"):
        sweep.prepare_model(preset, tmp_path)


def test_prepare_demo_and_small_vocab_models(tmp_path: Path) -> None:
    demo = sweep.prepare_model(sweep.PRESETS["cpu-demo"], tmp_path)
    assert demo.serve_arg == "demo" and demo.served_name == "demo"
    small = sweep.prepare_model(sweep.PRESETS["cpu-overhead"], tmp_path)
    assert small.served_name == "demo-small-vocab" and Path(small.serve_arg).is_dir()


FAKE_SERVER = textwrap.dedent("""
    import http.server, signal, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("child", child.pid, flush=True)
    if sys.argv[2] == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def child_pid(log: Path) -> int:
    for line in log.read_text().splitlines():
        if line.startswith("child"):
            return int(line.split()[1])
    raise AssertionError("no child pid in log")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; its state in /proc says it has exited.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
def test_server_start_and_stop_leave_no_process(tmp_path: Path, mode: str) -> None:
    port = sweep.free_port()
    log = tmp_path / "server.log"
    server = sweep.Server([sys.executable, "-c", FAKE_SERVER, str(port), mode], port, log)
    server.start(timeout_s=30)
    pid = child_pid(log)
    assert alive(pid) and alive(server.proc.pid)
    status = server.stop(grace_s=0.5)
    assert status == (-signal.SIGTERM if mode == "polite" else -signal.SIGKILL)
    deadline = time.monotonic() + 30  # a hang check, not a speed bound
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_server_that_exits_reports_its_log(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    server = sweep.Server(cmd, sweep.free_port(), tmp_path / "s.log")
    with pytest.raises(RuntimeError, match=r"exited with 3:\nno model here"):
        server.start(timeout_s=30)


def test_cell_from_record() -> None:
    record = {
        "completed": 4, "failed": 1, "request_throughput": 2.0, "output_throughput": 50.0,
        "total_output_tokens": 100, "mean_ttft_ms": 3.0, "mean_tpot_ms": 4.0,
        "correctness": {"correct_rate": 0.75},
    }
    c = sweep.cell_from_record(record)
    assert (c.mean_output_tokens, c.correct_rate, c.failed) == (25.0, 0.75, 1)


def test_failed_configurations_are_listed(result: SweepResult) -> None:
    result.errors["async/mp"] = "server exited with 1:\nboom"
    text = sweep_results.format_tables(result)
    assert "Failed configurations:\n  async/mp: server exited with 1: ... boom" in text


def test_repeats_give_medians_ranges_and_noise_verdicts() -> None:
    r = SweepResult("p", [0.0, 1.0])
    for req in (10.0, 12.0, 11.0):  # sync/uni
        r.add("sync/uni", "0.0", cell(req, 10 * req))
    for req in (12.5, 11.5, 13.0):  # overlaps sync's 10-12
        r.add("async/uni", "0.0", cell(req))
    for req in (13.0, 14.0, 15.0):  # above sync's range
        r.add("async/mp", "0.0", cell(req))
    assert r.cells["sync/uni"]["0.0"].request_throughput == 11.0
    assert r.cells["sync/uni"]["0.0"].output_throughput == 110.0
    assert r.cells["async/uni"]["0.0"].request_throughput == 12.5
    assert r.spread("sync/uni", "0.0") == (10.0, 12.0) and r.spread("x", "0.0") is None
    assert sweep_results.within_noise(r, "async/uni", "sync/uni", "0.0") is True
    assert sweep_results.within_noise(r, "async/mp", "sync/uni", "0.0") is False
    assert sweep_results.within_noise(r, "async/mp", "sync/uni", "1.0") is None
    h = sweep_results.headlines(r)
    assert h["async_speedup_at_0"] == pytest.approx(12.5 / 11.0)
    assert h["async_speedup_at_0_within_noise"] is True
    lines = sweep_results.comparisons(r)
    assert lines == [
        "  async/uni ÷ sync/uni at 0.0: 1.14× (range 0.96–1.30), within noise",
        "  async/mp ÷ sync/uni at 0.0: 1.27× (range 1.08–1.50), faster",
    ]
    text = sweep_results.format_tables(r)
    assert "median (min–max) of 3 interleaved repeats" in text
    assert "| sync/uni | 11.00 (10.00–12.00) | - |" in text
    assert "(within noise)" in text and "\n".join(lines) in text


def test_median_cell_needs_samples() -> None:
    with pytest.raises(ValueError, match="no samples"):
        sweep_results.median_cell([])
    two = sweep_results.median_cell([cell(1.0), Cell(3.0, 0.0, 1.0, 1.0, 1.0, None, 2)])
    assert two.request_throughput == 2.0 and two.failed == 2 and two.correct_rate == 1.0
