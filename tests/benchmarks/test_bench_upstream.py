"""Tests for benchmarks/bench_upstream.py: its summary of rounds, its workload, and one run
with this engine standing in for upstream (same weights and greedy: the same outputs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmarks.scripts import REPO, load_script

bench_upstream = load_script("bench_upstream")


def cell(tok_s: float, tokens: int = 64) -> dict:
    return {"tokens": tokens, "seconds": tokens / tok_s, "tok_s": tok_s}


def engine_round(plain: float, json_tok_s: float, tokens: int = 64) -> dict:
    return {"startup_s": 1.0, "plain": cell(plain, tokens), "json": cell(json_tok_s, tokens),
            "plain_sample": "a", "json_sample": "{"}


def test_ratios_are_taken_within_a_round() -> None:
    # Round 2 ran on a machine twice as slow: within-round ratios do not see it.
    rounds = [{"ours": engine_round(300.0, 270.0), "upstream": engine_round(200.0, 150.0)},
              {"ours": engine_round(150.0, 135.0), "upstream": engine_round(100.0, 75.0)}]
    summary = bench_upstream.summarize(rounds, output_len=16, num_prompts=4)
    assert summary["ratios"] == {"plain": 1.5, "json": 1.8}
    assert summary["engines"]["ours"]["json_over_plain"] == pytest.approx(0.9)
    assert summary["engines"]["upstream"]["plain"]["tok_s"] == 150.0
    assert summary["same_outputs"] is True


def test_short_runs_and_differing_outputs_are_flagged() -> None:
    rounds = [{"ours": engine_round(300.0, 270.0, tokens=60),
               "upstream": engine_round(200.0, 150.0)}]
    rounds[0]["upstream"]["json_sample"] = "["
    summary = bench_upstream.summarize(rounds, output_len=16, num_prompts=4)
    assert summary["engines"]["ours"]["plain"]["short_runs"] == [60]
    assert summary["engines"]["upstream"]["plain"]["short_runs"] == []
    assert summary["same_outputs"] is False


def test_the_schema_outlasts_the_output_length() -> None:
    schema = bench_upstream.structured_schema(96)
    assert len(schema["properties"]) == 5
    assert schema["required"][0] == "title"
    assert schema["properties"]["title"]["minLength"] == bench_upstream.CHARS_PER_TOKEN * 96


@pytest.mark.slow
def test_this_engine_against_itself(tmp_path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_upstream.py"),
         "--upstream-python", sys.executable, "--model", "demo", "--num-prompts", "2",
         "--output-len", "4", "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ours / upstream: plain" in proc.stdout
    result = json.loads(out.read_text())
    summary = result["summary"]
    for engine in ("ours", "upstream"):
        row = result["rounds"][0][engine]
        assert row["plain"]["tokens"] == row["json"]["tokens"] == 2 * 4
        assert summary["engines"][engine]["plain"]["short_runs"] == []
        assert row["json_sample"].lstrip().startswith("{")
    assert summary["same_outputs"] is True
