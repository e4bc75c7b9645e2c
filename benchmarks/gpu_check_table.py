"""The one table of benchmarks/gpu_check.sh: every step's status and the numbers it measured.

    python benchmarks/gpu_check_table.py RESULT_DIR

Reads what gpu_check.sh left in RESULT_DIR: steps.tsv (a line per step: name, exit status,
seconds), the steps' logs, decode.json (bench_decode.py), profile/profile.json
(gpu_profile.py) and sweep/sweep.json (structured_sweep.py). A step that did not run shows as "skipped"; a missing or unreadable
result file shows as "no result" instead of failing the table.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

Row = tuple[str, str, str]

# pytest's last line, e.g. "12 passed, 1 skipped in 95.31s (0:01:35)".
_PYTEST_TOTALS = re.compile(r"^=*\s*(\d+ \w+(?:, \d+ \w+)*) in [\d.]+s", re.MULTILINE)


def read_steps(result_dir: Path) -> dict[str, tuple[int, int]]:
    """Step name -> (exit status, seconds), from steps.tsv; {} when there is none."""
    steps: dict[str, tuple[int, int]] = {}
    path = result_dir / "steps.tsv"
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) == 3 and fields[1].lstrip("-").isdigit() and fields[2].isdigit():
            steps[fields[0]] = (int(fields[1]), int(fields[2]))
    return steps


def _status(steps: dict[str, tuple[int, int]], name: str) -> str:
    if name not in steps:
        return "skipped"
    rc, seconds = steps[name]
    return f"{'ok' if rc == 0 else f'FAILED (exit {rc})'}, {seconds} s"


def cuda_tests_rows(result_dir: Path, steps: dict[str, tuple[int, int]]) -> list[Row]:
    """The CUDA tests' row: status and pytest's totals."""
    status = _status(steps, "cuda_tests")
    log = result_dir / "cuda_tests.log"
    if "cuda_tests" in steps and log.exists():
        totals = _PYTEST_TOTALS.findall(log.read_text(errors="replace"))
        if totals:
            status += f": {totals[-1]}"
    return [("CUDA tests", "pytest", status)]


def decode_rows(result_dir: Path, steps: dict[str, tuple[int, int]]) -> list[Row]:
    """A row per batch size: tok/s with CUDA graphs, eager, and their ratio."""
    status = _status(steps, "bench_decode")
    try:
        results = json.loads((result_dir / "decode.json").read_text())
        graphs, eager = results["cuda-graphs"], results.get("eager", {})
    except (OSError, ValueError, KeyError, TypeError):
        return [("decode tok/s", "graphs / eager", status if "bench_decode" not in steps
                 else f"{status}: no result")]
    rows = []
    for batch in sorted(graphs, key=int):
        g, e = float(graphs[batch]), float(eager.get(batch, 0.0))
        ratio = f" = {g / e:.2f}x" if e else ""
        rows.append(("decode tok/s", f"batch {batch}", f"graphs {g:.1f} / eager {e:.1f}{ratio}"))
    return rows


def profile_rows(result_dir: Path, steps: dict[str, tuple[int, int]]) -> list[Row]:
    """A row per profiled run of gpu_profile.py: median wall and device-busy ms per decode
    step, syncs and kernel launches outside graphs per step."""
    status = _status(steps, "step_profile")
    try:
        runs = json.loads((result_dir / "profile" / "profile.json").read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        return [("step profile", "gpu_profile.py", status if "step_profile" not in steps
                 else f"{status}: no result")]
    rows = []
    for run in runs:
        done = run.get("steps") or []
        if not done:
            rows.append(("step profile", run.get("name", "?"), "no decode step recorded"))
            continue

        def median(key: str, done: list = done) -> float:
            values = sorted(float(s[key]) for s in done)
            return values[len(values) // 2]

        text = (f"wall {median('wall_ms'):.2f} ms, device busy {median('busy_ms'):.2f} ms, "
                f"{median('syncs'):.0f} syncs, {median('eager_launches'):.0f} eager launches, "
                f"{median('graph_replays'):.0f} graph replays per step")
        rows.append(("step profile", run.get("name", "?"), text))
    return rows


def sweep_rows(result_dir: Path, steps: dict[str, tuple[int, int]]) -> list[Row]:
    """A row per (configuration, ratio): req/s (with its ratio to sync/uni), output tok/s,
    and the share of structured outputs that were correct."""
    status = _status(steps, "sweep")
    try:
        sweep = json.loads((result_dir / "sweep" / "sweep.json").read_text())
        cells = sweep["cells"]
    except (OSError, ValueError, KeyError, TypeError):
        return [("sweep", "req/s", status if "sweep" not in steps else f"{status}: no result")]
    rows = []
    base = cells.get("sync/uni", {})
    labels = [f"{r:.1f}" for r in sweep.get("ratios", [])]
    for label in labels:
        for config, row in cells.items():
            cell = row.get(label)
            if cell is None:
                continue
            text = f"{cell['request_throughput']:.2f} req/s"
            reference = base.get(label)
            if config != "sync/uni" and reference and reference["request_throughput"]:
                ratio = cell["request_throughput"] / reference["request_throughput"]
                text += f" ({ratio:.2f}x sync/uni)"
            text += f", {cell['output_throughput']:.0f} tok/s"
            if cell.get("correct_rate") is not None:
                text += f", {100 * cell['correct_rate']:.0f}% correct"
            if cell.get("failed"):
                text += f", {cell['failed']} failed"
            rows.append(("sweep", f"{config}, {float(label):.0%} structured", text))
    for config, why in sweep.get("errors", {}).items():
        rows.append(("sweep", config, f"FAILED: {why.splitlines()[0] if why else ''}"))
    return rows or [("sweep", "req/s", f"{status}: no cells")]


def table(result_dir: Path) -> str:
    """The markdown table of everything gpu_check.sh measured in result_dir."""
    steps = read_steps(result_dir)
    rows: list[Row] = [("environment", "python, torch, CUDA", _status(steps, "environment"))]
    rows += cuda_tests_rows(result_dir, steps)
    rows.append(("attention kernels", "bench_attention.py", _status(steps, "bench_attention")))
    rows += decode_rows(result_dir, steps)
    rows += profile_rows(result_dir, steps)
    rows += sweep_rows(result_dir, steps)
    total = sum(seconds for _, seconds in steps.values())
    rows.append(("total", "all steps", f"{total} s"))
    lines = ["| check | setting | result |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Prints the table of the result directory given; 2 when none is given."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: gpu_check_table.py RESULT_DIR", file=sys.stderr)
        return 2
    print(table(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
