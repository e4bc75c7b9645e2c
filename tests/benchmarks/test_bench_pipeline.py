"""Tests for benchmarks/bench_pipeline.py: run order, statistics, headline ratios, commands.

No server is started; the benchmark itself takes minutes.
"""

from __future__ import annotations

import argparse
import json

import pytest

from tests.benchmarks.scripts import load_script
from vllm.benchmarks import structured_output, sweep
from vllm.benchmarks.sweep import ServedModel
from vllm.benchmarks.sweep_results import Cell

bp = load_script("bench_pipeline")


def run(rnd: int, config: str, ratio: str, req: float, tok: float = 0.0) -> object:
    return bp.Run(rnd, config, ratio, Cell(req, tok, 100.0, 1.0, 2.0, 1.0, 0))


@pytest.fixture
def runs() -> list:
    # pp1 at 0.0: 10, 12, 11; pp2/async at 0.0: 9, 9, 11 → per-round 0.9, 0.75, 1.0.
    # pp2/async at 1.0: 8.2, 9, 8.8 → ÷ 0.0 per round 0.911, 1.0, 0.8.
    return [
        run(1, "pp1", "0.0", 10, 1000), run(1, "pp1", "1.0", 9, 800),
        run(1, "pp2/async", "0.0", 9, 900), run(1, "pp2/async", "1.0", 8.2, 700),
        run(2, "pp1", "0.0", 12, 1200), run(2, "pp1", "1.0", 10, 900),
        run(2, "pp2/async", "0.0", 9, 950), run(2, "pp2/async", "1.0", 9, 760),
        run(3, "pp1", "0.0", 11, 1100), run(3, "pp1", "1.0", 11, 1000),
        run(3, "pp2/async", "0.0", 11, 1000), run(3, "pp2/async", "1.0", 8.8, 800),
    ]


def test_run_order_interleaves_rounds() -> None:
    assert bp.run_order(["a", "b", "c"], 2) == [
        (1, "a"), (1, "b"), (1, "c"), (2, "a"), (2, "b"), (2, "c"),
    ]
    assert bp.run_order(["pp2/async"], 1) == [(1, "pp2/async")]
    with pytest.raises(ValueError, match="repeats"):
        bp.run_order(["a"], 0)


def test_spread() -> None:
    assert bp.spread([3.0, 1.0, 2.0]) == bp.Spread(2.0, 1.0, 3.0, 3)
    assert bp.spread([4.0, 1.0]) == bp.Spread(2.5, 1.0, 4.0, 2)
    assert bp.spread([]) is None


def test_summarize_cells(runs: list) -> None:
    assert bp.summarize(runs, "pp1", "0.0", "request_throughput") == bp.Spread(11, 10, 12, 3)
    assert bp.summarize(runs, "pp2/async", "1.0", "output_throughput") == bp.Spread(
        760, 700, 800, 3
    )
    assert bp.summarize(runs, "pp1/async", "0.0", "request_throughput") is None


def test_paired_ratios_pair_by_round(runs: list) -> None:
    got = bp.paired_ratios(runs, ("pp2/async", "0.0"), ("pp1", "0.0"), "request_throughput")
    assert got == pytest.approx([0.9, 0.75, 1.0])
    # A round missing either cell is left out, as is a zero denominator.
    partial = [r for r in runs if not (r.round == 2 and r.config == "pp1")]
    partial.append(run(3, "pp1", "0.5", 0.0))
    assert bp.paired_ratios(partial, ("pp2/async", "0.0"), ("pp1", "0.0"),
                            "request_throughput") == pytest.approx([0.9, 1.0])
    assert bp.paired_ratios(partial, ("pp2/async", "0.0"), ("pp1", "0.5"),
                            "request_throughput") == []


def test_headline_values(runs: list) -> None:
    by_name = {h["name"]: h for h in bp.headline_values(runs)}
    at0 = by_name["pp2/async ÷ pp1 at 0.0"]
    assert at0["target"] == 0.85
    assert at0["request_throughput"]["median"] == pytest.approx(0.9)
    assert (at0["request_throughput"]["low"], at0["request_throughput"]["high"]) == \
        pytest.approx((0.75, 1.0))
    assert at0["output_throughput"]["median"] == pytest.approx(0.9)
    at1 = by_name["pp2/async ÷ pp1 at 1.0"]["request_throughput"]
    assert at1["median"] == pytest.approx(0.9) and at1["low"] == pytest.approx(0.8)
    retention = by_name["1.0 ÷ 0.0 under pp2/async"]
    assert retention["target"] == 0.90
    assert retention["request_throughput"]["median"] == pytest.approx(8.2 / 9)
    assert (retention["request_throughput"]["low"], retention["request_throughput"]["high"]) \
        == pytest.approx((0.8, 1.0))
    assert all(h["request_throughput"] is None for h in bp.headline_values([]))


def test_report_and_json(runs: list) -> None:
    result = bp.PipelineResult("cpu-test", ["pp1", "pp1/async", "pp2/async"], [0.0, 1.0], 3,
                               runs=runs)
    result.errors.append({"round": 2, "config": "pp1/async", "error": "server exited\nboom"})
    text = bp.format_report(result)
    assert "| config | 0.0 | 1.0 |" in text
    assert "| pp1 | 11.00 (10.00–12.00) | 10.00 (9.00–11.00) |" in text
    assert "| pp1/async | - | - |" in text
    assert "pp2/async ÷ pp1 at 0.0: 0.90× (0.75–1.00) in req/s" in text
    assert "(target ≥ 0.85: met)" in text and "(target ≥ 0.90: met)" in text
    assert "round 2 pp1/async: server exited ... boom" in text
    d = json.loads(json.dumps(result.to_dict()))
    assert d["summary"]["pp1"]["0.0"]["request_throughput"]["median"] == 11
    assert d["summary"]["pp1/async"]["1.0"]["output_throughput"] is None
    assert d["headlines"][2]["name"] == "1.0 ÷ 0.0 under pp2/async"


def test_below_target_is_reported() -> None:
    runs = [run(1, "pp1", "0.0", 10), run(1, "pp2/async", "0.0", 8)]
    result = bp.PipelineResult("p", ["pp1", "pp2/async"], [0.0], 1, runs=runs)
    assert "pp2/async ÷ pp1 at 0.0: 0.80× in req/s" in bp.format_report(result)
    assert "(target ≥ 0.85: below)" in bp.format_report(result)


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_serve_commands() -> None:
    model = ServedModel("/m", "deep", "/m")
    pp2 = bp.config_serve_command(model, "pp2/async", 4321, ["--max-num-seqs", "8"])
    assert flag(pp2, "-pp") == "2" and "--async-scheduling" in pp2
    assert flag(pp2, "--distributed-executor-backend") == "mp"
    assert flag(pp2, "--port") == "4321" and pp2[-2:] == ["--max-num-seqs", "8"]
    pp1 = bp.config_serve_command(model, "pp1", 1)
    # Async scheduling is the engine's default: the sync baseline must switch it off.
    assert "-pp" not in pp1 and "--async-scheduling" not in pp1
    assert "--no-async-scheduling" in pp1
    assert flag(pp1, "--distributed-executor-backend") == "uni"
    pp1_async = bp.config_serve_command(model, "pp1/async", 1)
    assert "-pp" not in pp1_async and "--async-scheduling" in pp1_async
    assert flag(pp1_async, "--distributed-executor-backend") == "uni"
    with pytest.raises(ValueError, match="config"):
        bp.config_serve_command(model, "pp4", 1)


def test_serve_flags_parse_as_the_engine_expects() -> None:
    from vllm.engine.arg_utils import EngineArgs

    preset = sweep.PIPELINE_PRESETS["cpu-pipeline"]
    cmd = bp.config_serve_command(ServedModel("/m", "deep", "/m"), "pp2/async", 1,
                                  preset.serve_args)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    known, _ = parser.parse_known_args(cmd[cmd.index("serve") + 2:])
    assert known.pipeline_parallel_size == 2 and known.async_scheduling
    assert known.distributed_executor_backend == "mp"


def test_preset_and_bench_flags() -> None:
    preset = sweep.PIPELINE_PRESETS["cpu-pipeline"]
    assert preset.model == "demo-small-vocab-deep"
    assert flag(list(preset.serve_args), "--max-model-len") == "1024"
    assert flag(list(preset.serve_args), "--max-num-seqs") == "64"
    assert "--structured-outputs-config.disable_any_whitespace" in preset.serve_args
    parser = structured_output.add_cli_args(argparse.ArgumentParser())
    model = ServedModel("/d", "demo-small-vocab-deep", "/d")
    args = parser.parse_args(sweep.bench_argv(preset, model, 1, 1.0, 8, output_len=16))
    assert (args.num_prompts, args.output_len, args.structured_output_ratio) == (8, 16, 1.0)


def test_check_args() -> None:
    configs, ratios = bp.check_args(bp.parse_args(["--configs", "pp1,pp2/async"]))
    assert configs == ["pp1", "pp2/async"] and ratios == [0.0, 1.0]
    for argv, message in (
        (["--configs", "pp3"], "--configs"),
        (["--ratios", "0,x"], "--ratios"),
        (["--ratios", "1.5"], "--ratios"),
        (["--repeats", "0"], "--repeats"),
        (["--output-len", "0"], "--output-len"),
    ):
        with pytest.raises(ValueError, match=message):
            bp.check_args(bp.parse_args(argv))
    assert bp.main(["--configs", "nope"]) == 2

