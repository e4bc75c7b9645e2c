"""Tests for vllm/benchmarks/structured_output.py against a fake server."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.benchmarks import structured_output
from vllm.benchmarks.assets import builtin_schema

REPO = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    return structured_output.add_cli_args(argparse.ArgumentParser()).parse_args(argv)


def run(server, tokenizer, *argv: str) -> dict:
    args = parse(["--base-url", server.url, "--disable-tqdm", *argv])
    return structured_output.run(args, tokenizer, quiet=True)


@pytest.mark.parametrize("dataset", ["json", "json-unique", "grammar", "regex", "choice"])
def test_valid_outputs_count_as_correct(fake_server, char_tokenizer, dataset: str) -> None:
    record = run(fake_server, char_tokenizer, "--dataset", dataset, "--num-prompts", "10",
                 "--structured-output-ratio", "0.6", "--output-len", "64")
    c = record["correctness"]
    assert (c["num_structured"], c["num_valid"], c["correct_rate"]) == (6, 6, 1.0)
    assert sum(record["structured"]) == 6
    assert [v is not None for v in record["valid"]] == record["structured"]
    assert record["completed"] == 10


def test_invalid_outputs_do_not_count(fake_server, char_tokenizer) -> None:
    record = run(fake_server, char_tokenizer, "--dataset", "json", "--num-prompts", "4",
                 "--extra-body", json.dumps({"fake_invalid": True}))
    c = record["correctness"]
    assert (c["num_structured"], c["num_valid"], c["correct_rate"]) == (4, 0, 0.0)
    assert c["stopped_correct_rate"] == 0.0


def test_truncated_outputs_are_invalid_and_not_stopped(fake_server, char_tokenizer) -> None:
    record = run(fake_server, char_tokenizer, "--dataset", "json", "--num-prompts", "3",
                 "--output-len", "5")
    c = record["correctness"]
    assert (c["num_valid"], c["num_stopped"]) == (0, 0)
    assert set(record["finish_reasons"]) == {"length"}


def test_unstructured_runs_report_no_correctness(fake_server, char_tokenizer) -> None:
    fake_server.reset()
    record = run(fake_server, char_tokenizer, "--dataset", "json", "--num-prompts", "3",
                 "--no-structured-output")
    assert record["correctness"]["num_structured"] == 0
    assert record["correctness"]["correct_rate"] is None
    assert record["structured_output_ratio"] == 0.0
    assert all("structured_outputs" not in r for r in fake_server.requests)


def test_chat_endpoint_and_saved_result(fake_server, char_tokenizer, tmp_path: Path) -> None:
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(json.dumps(builtin_schema()))
    record = run(fake_server, char_tokenizer, "--endpoint", "/v1/chat/completions",
                 "--json-schema-path", str(schema_path), "--num-prompts", "2",
                 "--save-results", "--result-dir", str(tmp_path), "--result-filename", "s.json")
    assert record["correctness"]["correct_rate"] == 1.0
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["dataset"] == "json" and saved["correctness"]["num_valid"] == 2


def test_report_text(fake_server, char_tokenizer, capsys) -> None:
    args = parse(["--base-url", fake_server.url, "--disable-tqdm", "--dataset", "choice",
                  "--num-prompts", "2"])
    structured_output.run(args, char_tokenizer)
    text = capsys.readouterr().out
    assert "Structured Output Benchmark" in text
    assert "Correct rate (%):" in text and "100.00" in text


@pytest.mark.parametrize("entry", ["script", "module"])
def test_script_and_module_reject_bad_flags(entry: str, tmp_path: Path) -> None:
    if entry == "script":
        command, cwd = [str(REPO / "benchmarks" / "benchmark_serving_structured_output.py")], REPO
    else:  # the package alone, run from outside the checkout
        command, cwd = ["-m", "vllm.benchmarks.structured_output"], tmp_path
    proc = subprocess.run(
        [sys.executable, *command, "--structured-output-ratio", "2", "--model", "m",
         "--tokenizer", "demo-tiny", "--port", "1"],
        capture_output=True, text=True, cwd=cwd, timeout=120,
    )
    assert proc.returncode == 2
    assert "--structured-output-ratio" in proc.stderr
