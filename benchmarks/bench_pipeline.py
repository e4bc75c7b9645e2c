"""Pipeline-parallel serving throughput on the same CPU cores: pp1, pp1/async and pp2/async.

For each configuration it starts `vllm serve` with the reduced-vocabulary deep demo model
(decoder layers dominate a step, so two stages are balanced), warms it up, runs the
structured-output serving benchmark at each structured-output ratio (0.0 and 1.0, same prompts)
and stops the server. Repeats are interleaved (pp1 round 1, pp1/async round 1, pp2/async
round 1, pp1 round 2, ...) so slow drifts in the machine's load hit every configuration alike.

It prints request and output-token throughput per (configuration, ratio) as the median with
its min-max spread, and the headline ratios, each the median (min-max) of per-round ratios:

- pp2/async ÷ pp1 at ratio 0.0 and at ratio 1.0 (target ≥ 0.85);
- ratio 1.0 ÷ ratio 0.0 under pp2/async (target ≥ 0.90).

It writes pipeline.json, pipeline.md, pipeline.png, server logs and per-run JSON into
--result-dir. A benchmark, not a test: nothing here asserts timing. The full run:

    .venv/bin/python benchmarks/bench_pipeline.py --repeats 3 --result-dir results/pipeline

A smoke run (minutes):

    .venv/bin/python benchmarks/bench_pipeline.py --num-prompts 8 --output-len 16 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm.benchmarks.sweep import (
    BENCH_COMMAND,
    PIPELINE_PRESETS,
    Preset,
    ServedModel,
    Server,
    add_run_flags,
    bench_argv,
    cell_from_record,
    free_port,
    parse_ratios,
    prepare_model,
    serve_command,
)
from vllm.benchmarks.sweep_results import Cell, first_and_last_line, ratio_label

# Each configuration is a sweep configuration (scheduler and executor backend) plus the flags
# that set its parallelism.
CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "pp1": ("sync/uni", ()),
    "pp1/async": ("async/uni", ()),
    "pp2/async": ("async/mp", ("-pp", "2")),
    # Not run by default: the same two stages as Ray actors, and two data-parallel engines.
    "pp2/async/ray": ("async/mp", ("-pp", "2", "--distributed-executor-backend", "ray")),
    "dp2/async": ("async/uni", ("-dp", "2")),
}
DEFAULT_CONFIGS = ("pp1", "pp1/async", "pp2/async")
RATIOS = (0.0, 1.0)
DEFAULT_PRESET = "cpu-pipeline"
DEFAULT_REPEATS = 3
METRICS = {"request_throughput": "req/s", "output_throughput": "output tok/s"}


@dataclass(frozen=True)
class Headline:
    """A throughput ratio numerator ÷ denominator, each a (configuration, ratio label) cell."""

    name: str
    numerator: tuple[str, str]
    denominator: tuple[str, str]
    target: float


HEADLINES = (
    Headline("pp2/async ÷ pp1 at 0.0", ("pp2/async", "0.0"), ("pp1", "0.0"), 0.85),
    Headline("pp2/async ÷ pp1 at 1.0", ("pp2/async", "1.0"), ("pp1", "1.0"), 0.85),
    Headline("1.0 ÷ 0.0 under pp2/async", ("pp2/async", "1.0"), ("pp2/async", "0.0"), 0.90),
)


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements."""

    median: float
    low: float
    high: float
    count: int


@dataclass
class Run:
    """One measured cell: a configuration at one ratio in one round (rounds count from 1)."""

    round: int
    config: str
    ratio: str
    cell: Cell


@dataclass
class PipelineResult:
    """Every run of the benchmark, plus what was run and what failed."""

    preset: str
    configs: list[str]
    ratios: list[float]
    repeats: int
    runs: list[Run] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    # {"round", "config", "error"} for each server that failed to start or run.
    errors: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the per-cell summaries and the headline ratios included."""
        out = asdict(self)
        out["summary"] = {
            config: {
                ratio_label(r): {
                    metric: _spread_dict(summarize(self.runs, config, ratio_label(r), metric))
                    for metric in METRICS
                }
                for r in self.ratios
            }
            for config in self.configs
        }
        out["headlines"] = headline_values(self.runs)
        return out


def run_order(configs: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """The (round, configuration) pairs in the order they run: every configuration once per
    round, rounds one after another. Raises ValueError if `repeats` is below 1."""
    if repeats < 1:
        raise ValueError(f"repeats: {repeats} is below 1")
    return [(rnd, config) for rnd in range(1, repeats + 1) for config in configs]


def spread(values: Sequence[float]) -> Spread | None:
    """Median, min and max of `values`; None when there are none."""
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values), len(values))


def samples(runs: Sequence[Run], config: str, ratio: str, metric: str) -> dict[int, float]:
    """The value of `metric` for one (configuration, ratio) cell, keyed by round."""
    return {
        run.round: getattr(run.cell, metric)
        for run in runs
        if run.config == config and run.ratio == ratio
    }


def summarize(runs: Sequence[Run], config: str, ratio: str, metric: str) -> Spread | None:
    """Median and range of `metric` for one (configuration, ratio) cell over the rounds."""
    return spread(list(samples(runs, config, ratio, metric).values()))


def paired_ratios(
    runs: Sequence[Run], numerator: tuple[str, str], denominator: tuple[str, str], metric: str
) -> list[float]:
    """numerator ÷ denominator for each round in which both cells were measured.

    Pairing by round compares runs made minutes apart, not hours, so drift in the machine's
    load cancels. Rounds with a zero denominator are left out.
    """
    num = samples(runs, *numerator, metric)
    den = samples(runs, *denominator, metric)
    return [num[rnd] / den[rnd] for rnd in sorted(num.keys() & den.keys()) if den[rnd]]


def headline_values(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Each headline with its target and, per metric, the spread of its per-round ratios
    (None where no round measured both cells)."""
    out = []
    for h in HEADLINES:
        entry: dict[str, Any] = {"name": h.name, "target": h.target}
        for metric in METRICS:
            entry[metric] = _spread_dict(spread(paired_ratios(runs, h.numerator, h.denominator,
                                                              metric)))
        out.append(entry)
    return out


def config_serve_command(
    model: ServedModel, config: str, port: int, serve_args: Sequence[str] = ()
) -> list[str]:
    """The `vllm serve` command line of one configuration. Raises ValueError for an unknown one."""
    if config not in CONFIGS:
        raise ValueError(f"config: {config!r} is not one of {', '.join(CONFIGS)}")
    base, parallel = CONFIGS[config]
    return serve_command(model, base, port, [*parallel, *serve_args])


def format_report(result: PipelineResult) -> str:
    """Markdown tables of request and output-token throughput (median and min–max per cell),
    the headline ratios with their targets, and any failures."""
    labels = [ratio_label(r) for r in result.ratios]
    blocks = []
    for metric, unit in METRICS.items():
        lines = [f"{unit}, preset {result.preset}, median (min–max) over rounds:", ""]
        lines.append("| config | " + " | ".join(labels) + " |")
        lines.append("|---|" + "---|" * len(labels))
        for config in result.configs:
            values = [_format_spread(summarize(result.runs, config, label, metric))
                      for label in labels]
            lines.append(f"| {config} | " + " | ".join(values) + " |")
        blocks.append("\n".join(lines))
    lines = ["Headline ratios, median (min–max) of per-round ratios:"]
    for entry in headline_values(result.runs):
        parts = [f"{_format_ratio(entry[m])} in {unit}" for m, unit in METRICS.items()]
        verdict = _verdict(entry["request_throughput"], entry["target"])
        lines.append(f"  {entry['name']}: " + ", ".join(parts)
                     + f"  (target ≥ {entry['target']:.2f}{verdict})")
    blocks.append("\n".join(lines))
    if result.errors:
        blocks.append("Failures:\n" + "\n".join(
            f"  round {e['round']} {e['config']}: {first_and_last_line(e['error'])}"
            for e in result.errors
        ))
    return "\n\n".join(blocks)


def run_benchmark(
    preset: Preset,
    result_dir: Path,
    configs: Sequence[str] = DEFAULT_CONFIGS,
    ratios: Sequence[float] = RATIOS,
    repeats: int = DEFAULT_REPEATS,
    num_prompts: int | None = None,
    output_len: int | None = None,
    extra_serve_args: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> PipelineResult:
    """Run every configuration at every ratio, `repeats` interleaved rounds, and write
    pipeline.json into result_dir.

    Each (round, configuration) gets a fresh server that runs all ratios; one that fails is
    recorded in `result.errors` and the benchmark goes on. Servers are always stopped. Raises
    ValueError for an unknown configuration or model, OSError if results cannot be written.
    """
    from vllm.benchmarks.serve import load_tokenizer

    for config in configs:
        if config not in CONFIGS:
            raise ValueError(f"config: {config!r} is not one of {', '.join(CONFIGS)}")
    order = run_order(configs, repeats)
    result_dir.mkdir(parents=True, exist_ok=True)
    model = prepare_model(preset, result_dir)
    tokenizer = load_tokenizer(model.tokenizer)
    result = PipelineResult(preset.name, list(configs), list(ratios), repeats)
    result.settings = {
        "preset": asdict(preset),
        "num_prompts": num_prompts or preset.num_prompts,
        "output_len": output_len or preset.output_len,
        "extra_serve_args": list(extra_serve_args),
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    bench = _Bench(preset, model, tokenizer, num_prompts, output_len, result_dir, result, log)
    for rnd, config in order:
        try:
            bench.run_server(rnd, config, ratios, extra_serve_args)
        except RuntimeError as e:
            result.errors.append({"round": rnd, "config": config, "error": str(e)})
            log(f"[round {rnd} {config}] FAILED: {e}")
    result.settings["loadavg_end"] = os.getloadavg()
    (result_dir / "pipeline.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result


@dataclass
class _Bench:
    """What every server of one benchmark shares."""

    preset: Preset
    model: ServedModel
    tokenizer: Any
    num_prompts: int | None
    output_len: int | None
    result_dir: Path
    result: PipelineResult
    log: Callable[[str], None]

    def run_server(
        self, rnd: int, config: str, ratios: Sequence[float], extra_serve_args: Sequence[str]
    ) -> None:
        """Start one configuration's server, warm it up, run every ratio into the result and
        stop it. Raises RuntimeError if the server does not start or a run cannot start."""
        from vllm.benchmarks import structured_output

        parser = structured_output.add_cli_args(argparse.ArgumentParser(prog=BENCH_COMMAND))
        slug = f"{config.replace('/', '-')}-round{rnd}"
        tag = f"[round {rnd} {config}]"
        port = free_port()
        cmd = config_serve_command(self.model, config, port,
                                   [*self.preset.serve_args, *extra_serve_args])
        self._note(f"\n{tag} $ {shlex.join(cmd)}", shlex.join(cmd))
        server = Server(cmd, port, self.result_dir / f"server-{slug}.log")
        started = time.monotonic()
        try:
            server.start(self.preset.server_timeout_s)
            self.log(f"{tag} ready in {time.monotonic() - started:.1f} s")
            warm = bench_argv(self.preset, self.model, port, 1.0, self.preset.warmup_prompts,
                              output_len=self.preset.warmup_output_len)
            structured_output.run(parser.parse_args(warm), self.tokenizer, quiet=True)
            for ratio in ratios:
                label = ratio_label(ratio)
                argv = bench_argv(self.preset, self.model, port, ratio, self.num_prompts, 0,
                                  self.result_dir, f"{slug}-ratio{label}.json", self.output_len)
                command = f"{BENCH_COMMAND} {shlex.join(argv)}"
                self._note(f"{tag} $ {command}", command)
                record = structured_output.run(parser.parse_args(argv), self.tokenizer,
                                               quiet=True)
                cell = cell_from_record(record)
                self.result.runs.append(Run(rnd, config, label, cell))
                self.log(f"{tag} ratio {label}: {cell.request_throughput:.2f} req/s, "
                         f"{cell.output_throughput:.1f} tok/s, "
                         f"{cell.mean_output_tokens:.1f} tok/req, failed {cell.failed}")
        finally:
            status = server.stop()
            self.log(f"{tag} server stopped (exit {status})")

    def _note(self, line: str, command: str) -> None:
        self.log(line)
        self.result.commands.append(command)


def write_chart(result: PipelineResult, path: Path) -> Path:
    """A grouped bar chart of median request throughput: groups = ratios, bars = configs."""
    from vllm.benchmarks.plot import bar_chart_png

    labels = [ratio_label(r) for r in result.ratios]
    series = {}
    for config in result.configs:
        medians = [summarize(result.runs, config, label, "request_throughput")
                   for label in labels]
        series[config] = [s.median if s else 0.0 for s in medians]
    title = f"median request throughput by structured-output ratio ({result.preset})"
    return bar_chart_png(path, title, labels, series, ylabel="requests/s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PIPELINE_PRESETS))
    parser.add_argument("--result-dir", default="results/pipeline",
                        help="Where logs and results go (default: results/pipeline).")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"Comma-separated subset of {', '.join(CONFIGS)} (default: "
                        f"{', '.join(DEFAULT_CONFIGS)}).")
    add_run_flags(parser, RATIOS)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="Interleaved rounds; each starts every configuration's server once.")
    parser.add_argument("--output-len", type=int, default=None,
                        help="Override the preset's output length (for smoke runs).")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    """The configurations and ratios the flags name. Raises ValueError naming the bad flag."""
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if not configs or unknown:
        raise ValueError(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    ratios = parse_ratios(args.ratios)
    for flag, value in (("--repeats", args.repeats), ("--num-prompts", args.num_prompts),
                        ("--output-len", args.output_len)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: {value} is below 1")
    return configs, ratios


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0, or 2 for bad flags and 1 if a server or run fails."""
    args = parse_args(argv)
    try:
        configs, ratios = check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result_dir = Path(args.result_dir)
    started = time.monotonic()
    try:
        result = run_benchmark(PIPELINE_PRESETS[args.preset], result_dir, configs, ratios,
                               args.repeats, args.num_prompts, args.output_len, args.serve_arg)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report = format_report(result)
    print("\n" + report)
    (result_dir / "pipeline.md").write_text(report + "\n", encoding="utf-8")
    try:
        write_chart(result, result_dir / "pipeline.png")
    except ImportError as e:
        # The chart is optional: matplotlib comes with the `bench` extra only.
        print(f"(no chart: {e})")
    print(f"\nTook {(time.monotonic() - started) / 60:.1f} min; results in {result_dir} "
          "(pipeline.json, pipeline.md, pipeline.png, server logs, per-run JSON).")
    return 1 if result.errors else 0


def _spread_dict(value: Spread | None) -> dict[str, Any] | None:
    return None if value is None else asdict(value)


def _format_spread(value: Spread | None) -> str:
    if value is None:
        return "-"
    if value.count == 1:
        return f"{value.median:.2f}"
    return f"{value.median:.2f} ({value.low:.2f}–{value.high:.2f})"


def _format_ratio(value: dict[str, Any] | None) -> str:
    if value is None:
        return "-"
    if value["count"] == 1:
        return f"{value['median']:.2f}×"
    return f"{value['median']:.2f}× ({value['low']:.2f}–{value['high']:.2f})"


def _verdict(value: dict[str, Any] | None, target: float) -> str:
    if value is None:
        return ""
    return ": met" if value["median"] >= target else ": below"



if __name__ == "__main__":
    sys.exit(main())
