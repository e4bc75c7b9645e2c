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
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass
class Cell:
    """One (configuration, ratio) measurement."""

    request_throughput: float
    output_throughput: float
    mean_output_tokens: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    correct_rate: float | None
    failed: int


def median_cell(samples: Sequence[Cell]) -> Cell:
    """One cell of the per-field medians of `samples` (failures summed). Raises ValueError
    for no samples."""
    if not samples:
        raise ValueError("median_cell: no samples")

    def median(name: str) -> Any:
        values = [getattr(c, name) for c in samples if getattr(c, name) is not None]
        return statistics.median(values) if values else None

    return Cell(
        request_throughput=median("request_throughput"),
        output_throughput=median("output_throughput"),
        mean_output_tokens=median("mean_output_tokens"),
        mean_ttft_ms=median("mean_ttft_ms"),
        mean_tpot_ms=median("mean_tpot_ms"),
        correct_rate=median("correct_rate"),
        failed=sum(c.failed for c in samples),
    )


@dataclass
class SweepResult:
    """All cells of a sweep, keyed by configuration then ratio label ("0.2"): `samples` holds
    every repeat, `cells` their medians."""

    preset: str
    ratios: list[float]
    cells: dict[str, dict[str, Cell]] = field(default_factory=dict)
    samples: dict[str, dict[str, list[Cell]]] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    # Configurations that failed, with why.
    errors: dict[str, str] = field(default_factory=dict)

    def add(self, config: str, label: str, cell: Cell) -> None:
        """Records one repeat of a cell and updates the cell's medians."""
        samples = self.samples.setdefault(config, {}).setdefault(label, [])
        samples.append(cell)
        self.cells.setdefault(config, {})[label] = median_cell(samples)

    def spread(self, config: str, label: str,
               attr: str = "request_throughput") -> tuple[float, float] | None:
        """(min, max) of `attr` over the repeats of a cell; None when it has none."""
        values = [getattr(c, attr) for c in self.samples.get(config, {}).get(label, [])]
        return (min(values), max(values)) if values else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the headline ratios included."""
        out = asdict(self)
        out["headlines"] = headlines(self)
        return out


def ratio_label(ratio: float) -> str:
    """"0.0", "0.2", "1.0": the column name of a ratio."""
    return f"{ratio:.1f}"


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
                f"correct {_pct(cell.correct_rate)}, failed {cell.failed}"
            )
    finally:
        status = server.stop()
        log(f"[{config}] server stopped (exit {status})")


def headlines(result: SweepResult) -> dict[str, Any]:
    """The two headline ratios (None where a needed cell is missing):

    - async_speedup: async/uni ÷ sync/uni request throughput at ratio 0.0 (target ≥ 1.3);
    - structured_retention: ratio 1.0 ÷ ratio 0.0 for the best configuration, the one with the
      highest mean request throughput over the ratios (target ≥ 0.9); also in output tokens/s.
    """
    cells = result.cells

    def get(config: str, ratio: str, attr: str = "request_throughput") -> float | None:
        cell = cells.get(config, {}).get(ratio)
        return getattr(cell, attr) if cell is not None else None

    sync0, async0 = get("sync/uni", "0.0"), get("async/uni", "0.0")
    speedup = async0 / sync0 if sync0 and async0 is not None else None
    noise = within_noise(result, "async/uni", "sync/uni", "0.0")
    measured = {c: row for c, row in cells.items() if row}
    best = max(
        measured,
        key=lambda c: sum(x.request_throughput for x in measured[c].values()) / len(measured[c]),
        default=None,
    )
    retention = retention_tok = None
    if best is not None:
        r0, r1 = get(best, "0.0"), get(best, "1.0")
        t0, t1 = get(best, "0.0", "output_throughput"), get(best, "1.0", "output_throughput")
        retention = r1 / r0 if r0 and r1 is not None else None
        retention_tok = t1 / t0 if t0 and t1 is not None else None
    return {
        "async_speedup_at_0": speedup,
        "async_speedup_at_0_within_noise": noise,
        "best_config": best,
        "structured_retention_best": retention,
        "structured_retention_best_tokens": retention_tok,
    }


def within_noise(result: SweepResult, a: str, b: str, label: str) -> bool | None:
    """True when the request-throughput ranges (min–max over the repeats) of two cells
    overlap, so their difference is not established; None when a cell is missing."""
    sa, sb = result.spread(a, label), result.spread(b, label)
    if sa is None or sb is None:
        return None
    return sa[0] <= sb[1] and sb[0] <= sa[1]


def comparisons(result: SweepResult, baseline: str = "sync/uni") -> list[str]:
    """One line per (configuration, ratio): its median request throughput ÷ the baseline's,
    the ratio's range over the repeats, and whether it is within noise."""
    lines = []
    for config, row in result.cells.items():
        if config == baseline:
            continue
        for label in [ratio_label(r) for r in result.ratios]:
            base = result.cells.get(baseline, {}).get(label)
            cell, sa, sb = row.get(label), result.spread(config, label), result.spread(
                baseline, label)
            if cell is None or base is None or not base.request_throughput or not sa or not sb:
                continue
            verdict = "within noise" if within_noise(result, config, baseline, label) else (
                "faster" if cell.request_throughput > base.request_throughput else "slower")
            lines.append(
                f"  {config} ÷ {baseline} at {label}: "
                f"{cell.request_throughput / base.request_throughput:.2f}× "
                f"(range {sa[0] / sb[1]:.2f}–{sa[1] / sb[0]:.2f}), {verdict}"
            )
    return lines


def format_tables(result: SweepResult) -> str:
    """Markdown tables (request throughput, output tokens/s, tokens per request, correctness)
    and the headline ratios."""
    labels = [ratio_label(r) for r in result.ratios]
    blocks = []
    for title, attr, fmt in (
        ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
        ("Output token throughput (tok/s)", "output_throughput", "{:.1f}"),
        ("Mean output tokens per request", "mean_output_tokens", "{:.1f}"),
        ("Correct structured outputs", "correct_rate", None),
    ):
        lines = [f"{title}, preset {result.preset}:", ""]
        lines.append("| config | " + " | ".join(labels) + " |")
        lines.append("|---|" + "---|" * len(labels))
        for config, row in result.cells.items():
            values = []
            for label in labels:
                cell = row.get(label)
                spread = result.spread(config, label, attr) if fmt is not None else None
                if cell is None:
                    values.append("-")
                elif fmt is None:
                    values.append(_pct(cell.correct_rate))
                elif spread is not None and spread[0] != spread[1]:
                    low, high = (fmt.format(v) for v in spread)
                    values.append(f"{fmt.format(getattr(cell, attr))} ({low}–{high})")
                else:
                    values.append(fmt.format(getattr(cell, attr)))
            lines.append(f"| {config} | " + " | ".join(values) + " |")
        blocks.append("\n".join(lines))
    repeats = max((len(v) for row in result.samples.values() for v in row.values()), default=1)
    if repeats > 1:
        blocks[0] = blocks[0].replace(
            "Request throughput (req/s)",
            f"Request throughput (req/s), median (min–max) of {repeats} interleaved repeats", 1)
    compared = comparisons(result)
    if compared:
        blocks.append("Against sync/uni (request throughput; within noise when the "
                      "min–max ranges overlap):\n" + "\n".join(compared))
    h = headlines(result)
    blocks.append(
        "Headline ratios:\n"
        f"  async/uni ÷ sync/uni at 0.0 (request throughput): {_ratio(h['async_speedup_at_0'])}"
        f"{' (within noise)' if h['async_speedup_at_0_within_noise'] else ''}"
        "  (target ≥ 1.30)\n"
        f"  1.0 ÷ 0.0 for the best config ({h['best_config']}): "
        f"{_ratio(h['structured_retention_best'])} in req/s, "
        f"{_ratio(h['structured_retention_best_tokens'])} in output tok/s  (target ≥ 0.90)"
    )
    if result.errors:
        blocks.append("Failed configurations:\n" + "\n".join(
            f"  {config}: {first_and_last_line(why)}" for config, why in result.errors.items()
        ))
    return "\n\n".join(blocks)


def write_chart(result: SweepResult, path: Path) -> Path:
    """A grouped bar chart of request throughput: groups = ratios, bars = configurations."""
    from vllm.benchmarks.plot import bar_chart_png

    labels = [ratio_label(r) for r in result.ratios]
    series = {
        config: [row[label].request_throughput if label in row else 0.0 for label in labels]
        for config, row in result.cells.items()
    }
    title = f"request throughput by structured-output ratio ({result.preset})"
    return bar_chart_png(path, title, labels, series, ylabel="requests/s")


def first_and_last_line(text: str) -> str:
    """A failure's text in one line: its first and last non-blank lines (a traceback's
    header and its error)."""
    lines = [line for line in text.strip().splitlines() if line.strip()] or ["?"]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1].strip()}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"
