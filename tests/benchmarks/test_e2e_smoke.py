"""End-to-end smoke test: both benchmarks against a real `vllm serve demo-tiny` (few prompts)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm.benchmarks import serve, structured_output
from vllm.benchmarks.sweep import Server, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "demo-tiny",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
        "--max-num-seqs", "8", "--disable-log-requests",
    ]  # no --structured-outputs-config: a demo model serves compact JSON by default
    srv = Server(cmd, port, tmp_path_factory.mktemp("logs") / "server.log")
    srv.start(timeout_s=300)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def test_structured_benchmark_against_demo_tiny(server: Server, tmp_path: Path) -> None:
    parser = structured_output.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args([
        "--port", str(server.port), "--dataset", "json", "--num-prompts", "4",
        "--structured-output-ratio", "0.5", "--output-len", "128", "--disable-tqdm",
        "--save-results", "--result-dir", str(tmp_path),
    ])
    record = structured_output.run(args, quiet=True)
    assert record["model"] == "demo-tiny"
    assert (record["completed"], record["failed"]) == (4, 0)
    c = record["correctness"]
    assert c["num_structured"] == 2
    # Outputs that stopped by themselves must all be valid; truncated ones cannot be.
    assert c["num_stopped_valid"] == c["num_stopped"] and c["num_stopped"] >= 1
    unstructured = [n for n, s in zip(record["output_lens"], record["structured"]) if not s]
    assert all(0 < n <= 128 for n in unstructured)
    assert record["total_output_tokens"] == sum(record["output_lens"])
    assert list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("dataset", ["json", "regex"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_demo_outputs_are_correct(server: Server, dataset: str, temperature: float) -> None:
    """The demo tells the truth: with its default options and its closing-token tilt, the
    benchmark's structured outputs close well within the length limit and validate, under
    greedy decoding (the client's default) and under sampling."""
    parser = structured_output.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args([
        "--port", str(server.port), "--dataset", dataset, "--num-prompts", "8",
        "--structured-output-ratio", "1.0", "--output-len", "128", "--disable-tqdm",
        "--extra-body", f'{{"temperature": {temperature}, "seed": 1}}',
    ])
    record = structured_output.run(args, quiet=True)
    c = record["correctness"]
    assert c["num_structured"] == 8
    assert c["correct_rate"] >= 0.9, c


def test_bench_serve_against_demo_tiny(server: Server) -> None:
    parser = serve.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args([
        "--port", str(server.port), "--num-prompts", "4", "--random-input-len", "16",
        "--random-output-len", "8", "--ignore-eos", "--disable-tqdm",
        "--endpoint", "/v1/chat/completions", "--extra-body", '{"top_k": 3, "temperature": 0.5}',
    ])
    record = serve.main(args)
    assert (record["completed"], record["failed"]) == (4, 0)
    assert record["output_lens"] == [8] * 4  # ignore_eos: exactly max tokens
    assert record["mean_ttft_ms"] > 0 and record["mean_tpot_ms"] > 0
