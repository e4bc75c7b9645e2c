"""Sweep {sync, async} × {uni, mp} × structured-output ratios {0, 0.2, 0.8, 1.0}.

Starts `vllm serve` once per configuration and round (--repeats rounds, interleaved), runs
benchmark_serving_structured_output.py at each ratio (same prompts), stops the server, then
prints the request-throughput table (median and min-max of the repeats), each configuration
against sync/uni (or "within noise"), the two headline ratios, and writes sweep.json,
sweep.md and sweep.png into --result-dir.

    python benchmarks/structured_sweep.py --preset cpu-overhead
    python benchmarks/structured_sweep.py --preset cpu-demo
    python benchmarks/structured_sweep.py --preset gpu --result-dir results/gpu
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vllm.benchmarks.sweep import CONFIGS, PRESETS, RATIOS, add_run_flags, parse_ratios, run_sweep
from vllm.benchmarks.sweep_results import format_tables


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The sweep's flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-overhead", choices=sorted(PRESETS))
    parser.add_argument("--result-dir", default=None,
                        help="Where logs and results go (default: results/sweep-<preset>).")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"Comma-separated subset of {', '.join(CONFIGS)}.")
    add_run_flags(parser, RATIOS)
    parser.add_argument("--structured-outputs-backend", default=None,
                        choices=("auto", "xgrammar", "guidance"),
                        help="The servers' structured-output backend (default: the server's, "
                        "auto).")
    parser.add_argument("--repeats", type=int, default=3,
                        help="Rounds of every configuration; each cell reports the median and "
                        "min-max of its repeats (default: 3).")
    parser.add_argument("--list-presets", action="store_true", help="Describe presets and exit.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; returns 0, or 2 for bad flags and 1 if a server or run fails."""
    args = parse_args(argv)
    if args.list_presets:
        for preset in PRESETS.values():
            print(f"{preset.name}: {preset.description}; model {preset.model}, "
                  f"{preset.num_prompts} prompts, output {preset.output_len}, "
                  f"rate {preset.request_rate}, max concurrency {preset.max_concurrency}")
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"error: --configs: unknown {unknown}; known: {list(CONFIGS)}", file=sys.stderr)
        return 2
    try:
        ratios = parse_ratios(args.ratios)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    preset = PRESETS[args.preset]
    result_dir = Path(args.result_dir or f"results/sweep-{preset.name}")
    started = time.monotonic()
    try:
        serve_args = list(args.serve_arg)
        if args.structured_outputs_backend is not None:
            serve_args += ["--structured-outputs-config.backend", args.structured_outputs_backend]
        result = run_sweep(preset, result_dir, configs, ratios, args.num_prompts, serve_args,
                           repeats=args.repeats)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tables = format_tables(result)
    elapsed = time.monotonic() - started
    print("\n" + tables)
    print(f"\nSweep took {elapsed / 60:.1f} min; results in {result_dir} "
          "(sweep.json, sweep.md, sweep.png, server logs, per-run JSON).")
    (result_dir / "sweep.md").write_text(tables + "\n", encoding="utf-8")
    return 1 if result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
