"""Tests for vllm/entrypoints/cli/benchmark.py (`vllm bench serve`)."""

from __future__ import annotations

import socket

import pytest

from vllm.entrypoints.cli.main import discover_subcommands, main


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_is_registered() -> None:
    assert "bench" in [c.name for c in discover_subcommands()]


def test_bench_without_kind_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 1
    assert "serve" in capsys.readouterr().out


def test_bench_serve_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--dataset-name", "--extra-body", "--request-rate", "--burstiness",
                 "--max-concurrency", "--goodput", "--save-results", "--random-input-len"):
        assert flag in text, flag


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--num-prompts", "0", "--model", "m"]) == 2
    assert "--num-prompts" in capsys.readouterr().err
    assert main(["bench", "serve", "--model", "m", "--extra-body", "[1]"]) == 2


def test_unreachable_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "serve", "--port", str(closed_port()), "--model", "m",
               "--tokenizer", "demo-tiny", "--num-prompts", "2", "--random-input-len", "8",
               "--random-output-len", "2", "--disable-tqdm"])
    assert rc == 1
    assert "initial test request failed" in capsys.readouterr().err
