"""The async × structured-output sweep behind benchmarks/structured_sweep.py.

For each engine configuration (sync/uni, async/uni, sync/mp, async/mp) it starts `vllm serve`, runs the
structured-output benchmark at each structured-output ratio with the same prompts, stops the
server, and reports request throughput per (configuration, ratio) plus the two headline
ratios: async/uni ÷ sync/uni at ratio 0, and ratio 1 ÷ ratio 0 for the best configuration.

These machines are noisy, so the sweep runs in rounds: each round runs every configuration
once (a fresh server each time), so the repeats of a cell are interleaved with the other
cells, never back to back. A cell reports the median of its repeats and the min–max spread;
a comparison whose spreads overlap is reported as within noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm.benchmarks.sweep_results import (
    Cell,
    SweepResult,
    percent,
    ratio_label,
    write_chart,
)

CONFIGS: dict[str, tuple[bool, str]] = {
    "sync/uni": (False, "uni"),
    "async/uni": (True, "uni"),
    "sync/mp": (False, "mp"),
    "async/mp": (True, "mp"),
}
RATIOS = (0.0, 0.2, 0.8, 1.0)
# How the logged per-cell commands run the benchmark (they work from any directory).
BENCH_COMMAND = "python -m vllm.benchmarks.structured_output"
# Random weights favour whitespace inside JSON; compact JSON keeps outputs short and valid.
_COMPACT_JSON = ("--structured-outputs-config.disable_any_whitespace", "true")


@dataclass(frozen=True)
class Preset:
    """One sweep workload: model, load shape and extra `vllm serve` flags."""

    name: str
    description: str
    # A demo model name, a reduced-vocabulary demo name, or a name in assets.MODEL_CONFIG_NAMES.
    model: str
    num_prompts: int
    output_len: int
    request_rate: float
    max_concurrency: int | None
    serve_args: tuple[str, ...] = ()
    warmup_prompts: int = 16
    # Short warm-up outputs: enough to compile the grammar and warm the engine.
    warmup_output_len: int = 16
    server_timeout_s: float = 600.0


PRESETS: dict[str, Preset] = {
    "cpu-overhead": Preset(
        name="cpu-overhead",
        description="tiny Qwen3 body, 8,192-token Qwen vocabulary: engine overhead dominates",
        model="demo-small-vocab",
        num_prompts=192,
        output_len=128,
        request_rate=math.inf,
        max_concurrency=64,
        serve_args=("--max-model-len", "1024", "--max-num-seqs", "64", *_COMPACT_JSON),
    ),
    "cpu-demo": Preset(
        name="cpu-demo",
        description="the demo model (hidden 256, 4 layers) with Qwen's full 151,936 vocabulary",
        model="demo",
        num_prompts=32,
        output_len=128,
        request_rate=math.inf,
        max_concurrency=32,
        serve_args=("--max-model-len", "1024", "--max-num-seqs", "32", *_COMPACT_JSON),
        warmup_prompts=8,
    ),
    "gpu": Preset(
        name="gpu",
        description="Qwen3-1.7B config, dummy weights, upstream load shape",
        model="qwen3-1.7b",
        num_prompts=4000,
        output_len=128,
        request_rate=200.0,
        max_concurrency=800,
        serve_args=(
            "--load-format", "dummy", "--max-model-len", "4096", "--max-num-seqs", "1024",
            *_COMPACT_JSON,
        ),
        warmup_prompts=64,
    ),
}

# Workloads of benchmarks/bench_pipeline.py. Kept apart from PRESETS: the sweep's
# configurations never split the model into pipeline stages.
PIPELINE_PRESETS: dict[str, Preset] = {
    "cpu-pipeline": Preset(
        name="cpu-pipeline",
        description="hidden 512, 8 layers, 8,192-token Qwen vocabulary: decoder layers dominate "
        "a step, so two pipeline stages are balanced",
        model="demo-small-vocab-deep",
        num_prompts=128,
        output_len=128,
        request_rate=math.inf,
        max_concurrency=64,
        serve_args=("--max-model-len", "1024", "--max-num-seqs", "64", *_COMPACT_JSON),
    ),
}


@dataclass
class ServedModel:
    """How to name a preset's model to the server and to the benchmark client."""

    serve_arg: str
    served_name: str
    tokenizer: str


def prepare_model(preset: Preset, workdir: Path) -> ServedModel:
    """Build or assemble the preset's model directory and say how to name it.

    For a shipped model config the directory is assembled in `workdir` from that config.json
    plus the demo model's tokenizer files (its weights come from --load-format dummy). Raises
    ValueError for an unknown model.
    """
    from vllm.benchmarks.assets import MODEL_CONFIG_NAMES, model_config
    from vllm.model_executor.model_loader import demo_small_vocab
    from vllm.model_executor.model_loader.demo_model import DEMO_MODELS, build_demo_model

    if preset.model in DEMO_MODELS:
        path = build_demo_model(preset.model)
        return ServedModel(preset.model, preset.model, str(path))
    small = demo_small_vocab.resolve(preset.model)
    if small is not None:
        return ServedModel(str(small), preset.model, str(small))
    if preset.model not in MODEL_CONFIG_NAMES:
        raise ValueError(
            f"preset.model: {preset.model!r} is neither a demo model nor a shipped config "
            f"({', '.join(MODEL_CONFIG_NAMES)})"
        )
    target = workdir / "models" / preset.model
    target.mkdir(parents=True, exist_ok=True)
    config = json.dumps(model_config(preset.model), indent=2) + "\n"
    (target / "config.json").write_text(config, encoding="utf-8")
    demo = build_demo_model("demo-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(demo / name, target / name)
    return ServedModel(str(target), preset.model, str(target))


def add_run_flags(parser: argparse.ArgumentParser, ratios: Sequence[float]) -> None:
    """Adds the flags every sweep script takes the same way: --ratios (default `ratios`),
    --num-prompts and --serve-arg."""
    parser.add_argument("--ratios", default=",".join(str(r) for r in ratios),
                        help="Comma-separated structured-output ratios.")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="Override the preset's number of prompts per run.")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="Extra `vllm serve` flag; repeat it, e.g. "
                        "--serve-arg=--max-num-seqs=32.")


def parse_ratios(text: str) -> list[float]:
    """The structured-output ratios of a --ratios value. Raises ValueError naming the flag
    unless it is a non-empty list of numbers in [0, 1]."""
    try:
        ratios = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--ratios: {text!r} is not a list of numbers") from None
    if not ratios or any(not 0.0 <= r <= 1.0 for r in ratios):
        raise ValueError("--ratios: each ratio must be in [0, 1]")
    return ratios


def serve_command(
    model: ServedModel, config: str, port: int, serve_args: Sequence[str] = ()
) -> list[str]:
    """The `vllm serve` command line of one configuration. Raises ValueError for an unknown one."""
    if config not in CONFIGS:
        raise ValueError(f"config: {config!r} is not one of {', '.join(CONFIGS)}")
    async_sched, backend = CONFIGS[config]
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model.serve_arg,
        "--served-model-name", model.served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--distributed-executor-backend", backend,
        "--disable-log-requests", "--uvicorn-log-level", "warning",
    ]
    # Both modes are spelled out: the engine's default (async) must not decide what a
    # "sync/..." configuration measures.
    cmd.append("--async-scheduling" if async_sched else "--no-async-scheduling")
    return cmd + list(serve_args)


def bench_argv(
    preset: Preset,
    model: ServedModel,
    port: int,
    ratio: float,
    num_prompts: int | None = None,
    seed: int = 0,
    result_dir: Path | None = None,
    result_filename: str | None = None,
    output_len: int | None = None,
) -> list[str]:
    """Flags of benchmark_serving_structured_output.py for one cell (preset values unless
    overridden)."""
    argv = [
        "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
        "--model", model.served_name, "--tokenizer", model.tokenizer,
        "--dataset", "json", "--structured-output-ratio", str(ratio),
        "--num-prompts", str(num_prompts or preset.num_prompts),
        "--output-len", str(output_len or preset.output_len),
        "--request-rate", "inf" if math.isinf(preset.request_rate) else str(preset.request_rate),
        "--seed", str(seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
    ]
    if preset.max_concurrency:
        argv += ["--max-concurrency", str(preset.max_concurrency)]
    if result_dir is not None:
        argv += ["--save-results", "--result-dir", str(result_dir)]
        if result_filename:
            argv += ["--result-filename", result_filename]
    return argv


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `vllm serve` child process in its own process group, logging to a file."""

    def __init__(self, cmd: list[str], port: int, log_path: Path) -> None:
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        """Start the server and wait until /health answers 200.

        Raises RuntimeError (with the log's tail) if it exits or is not ready in time; the
        process is stopped first.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w", encoding="utf-8")
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> int | None:
        """Stop the server like Ctrl-C (SIGTERM); kill its process group if it lingers.

        Returns the exit status (None if it had not started).
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Worker processes live in the server's group; none may outlive the sweep.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def cell_from_record(record: dict[str, Any]) -> Cell:
    """The sweep cell of one benchmark result record."""
    completed = record["completed"]
    return Cell(
        request_throughput=record["request_throughput"],
        output_throughput=record["output_throughput"],
        mean_output_tokens=record["total_output_tokens"] / completed if completed else 0.0,
        mean_ttft_ms=record.get("mean_ttft_ms", 0.0),
        mean_tpot_ms=record.get("mean_tpot_ms", 0.0),
        correct_rate=record["correctness"]["correct_rate"],
        failed=record["failed"],
    )


def run_sweep(
    preset: Preset,
    result_dir: Path,
    configs: Sequence[str] = tuple(CONFIGS),
    ratios: Sequence[float] = RATIOS,
    num_prompts: int | None = None,
    extra_serve_args: Sequence[str] = (),
    log: Callable[[str], None] = print,
    repeats: int = 3,
) -> SweepResult:
    """Run every (configuration, ratio) cell `repeats` times, in rounds that each run every
    configuration once, and write sweep.json and sweep.png to result_dir.

    A configuration whose server fails to start or whose run fails is recorded in
    `result.errors` and left out of the later rounds; servers are always stopped.
    Raises ValueError for an unknown configuration or model or repeats < 1, OSError if
    results cannot be written.
    """
    if repeats < 1:
        raise ValueError(f"repeats: must be at least 1, got {repeats}")
    # Imported first so a missing matplotlib fails now, not after the sweep has run.
    from vllm.benchmarks.plot import bar_chart_png  # noqa: F401
    from vllm.benchmarks.serve import load_tokenizer

    result_dir.mkdir(parents=True, exist_ok=True)
    model = prepare_model(preset, result_dir)
    tokenizer = load_tokenizer(model.tokenizer)
    result = SweepResult(preset.name, list(ratios))
    result.settings = {
        "preset": asdict(preset),
        "num_prompts": num_prompts or preset.num_prompts,
        "extra_serve_args": list(extra_serve_args),
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "repeats": repeats,
    }
    for round_ in range(repeats):
        for config in configs:
            if config in result.errors:
                continue
            try:
                _run_config(preset, model, tokenizer, config, ratios, num_prompts,
                            extra_serve_args, result_dir, result, log, round_)
            except RuntimeError as e:
                result.errors[config] = str(e)
                log(f"[{config}] FAILED: {e}")
            save_result(result, result_dir)
    write_chart(result, result_dir / "sweep.png")
    return result


def save_result(result: SweepResult, result_dir: Path) -> None:
    """Writes result_dir/sweep.json (called after every cell, so that a sweep stopped by a
    time limit keeps everything it measured)."""
    result.settings["loadavg_end"] = os.getloadavg()
    (result_dir / "sweep.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")


def _run_config(
    preset: Preset,
    model: ServedModel,
    tokenizer: Any,
    config: str,
    ratios: Sequence[float],
    num_prompts: int | None,
    extra_serve_args: Sequence[str],
    result_dir: Path,
    result: SweepResult,
    log: Callable[[str], None],
    round_: int = 0,
) -> None:
    """Start one configuration's server, warm it up, run every ratio once into `result`
    (round `round_`), stop it.

    Raises RuntimeError if the server does not start or a run cannot start.
    """
    from vllm.benchmarks import structured_output

    parser = structured_output.add_cli_args(
        argparse.ArgumentParser(prog="benchmark_serving_structured_output.py")
    )
    port = free_port()
    cmd = serve_command(model, config, port, [*preset.serve_args, *extra_serve_args])
    log(f"\n[{config}] $ {shlex.join(cmd)}")
    result.commands.append(shlex.join(cmd))
    tag = f"{config.replace('/', '-')}-r{round_}"
    server = Server(cmd, port, result_dir / f"server-{tag}.log")
    started = time.monotonic()
    try:
        server.start(preset.server_timeout_s)
        log(f"[{config}] ready in {time.monotonic() - started:.1f} s")
        warm = bench_argv(
            preset, model, port, 1.0, preset.warmup_prompts, output_len=preset.warmup_output_len
        )
        structured_output.run(parser.parse_args(warm), tokenizer, quiet=True)
        for ratio in ratios:
            name = f"{tag}-ratio{ratio_label(ratio)}.json"
            argv = bench_argv(preset, model, port, ratio, num_prompts, 0, result_dir, name)
            command = f"{BENCH_COMMAND} {shlex.join(argv)}"
            log(f"[{config}] $ {command}")
            result.commands.append(command)
            record = structured_output.run(parser.parse_args(argv), tokenizer, quiet=True)
            cell = cell_from_record(record)
            result.add(config, ratio_label(ratio), cell)
            save_result(result, result_dir)
            log(
                f"[{config} r{round_}] ratio {ratio_label(ratio)}: "
                f"{cell.request_throughput:.2f} req/s, "
                f"{cell.output_throughput:.1f} tok/s, {cell.mean_output_tokens:.1f} tok/req, "
                f"correct {percent(cell.correct_rate)}, failed {cell.failed}"
            )
    finally:
        status = server.stop()
        log(f"[{config}] server stopped (exit {status})")
