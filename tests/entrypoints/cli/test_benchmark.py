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
                 "--max-concurrency", "--goodput", "--save-results", "--random-input-len",
                 "--ready-check-timeout-sec", "--trust-remote-code"):
        assert flag in text, flag


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--num-prompts", "0", "--model", "m"]) == 2
    assert "--num-prompts" in capsys.readouterr().err
    assert main(["bench", "serve", "--model", "m", "--extra-body", "[1]"]) == 2


def test_unreachable_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "serve", "--port", str(closed_port()), "--model", "m",
               "--tokenizer", "demo-tiny", "--num-prompts", "2", "--random-input-len", "8",
               "--random-output-len", "2", "--disable-tqdm", "--ready-check-timeout-sec", "0"])
    assert rc == 1
    assert "initial test request failed" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_ready_check_gives_up_after_its_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    port = closed_port()
    rc = main(["bench", "serve", "--port", str(port), "--model", "m", "--num-prompts", "2",
               "--ready-check-timeout-sec", "1", "--disable-tqdm"])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"the server at http://127.0.0.1:{port} was not ready within 1 s" in err
    assert "--ready-check-timeout-sec" in err
    assert main(["bench", "serve", "--model", "m", "--ready-check-timeout-sec", "-1"]) == 2
    assert "--ready-check-timeout-sec: must be 0 or more" in capsys.readouterr().err


def test_upstream_report_bench_command_parses() -> None:
    from vllm.entrypoints.cli.arg_parser import prepare_argv
    from vllm.entrypoints.cli.main import make_parser

    argv = ("bench serve --model M --ready-check-timeout-sec 1 --dataset-name random "
            "--random-input-len=1024 --random-output-len=512 --ignore-eos --port=8000 "
            "--host 0.0.0.0 --num-prompt 30 --request-rate inf --backend vllm "
            "--trust-remote-code").split()
    args = make_parser(discover_subcommands()).parse_args(prepare_argv(argv))
    assert (args.model, args.ready_check_timeout_sec, args.dataset_name) == ("M", 1.0, "random")
    assert (args.random_input_len, args.random_output_len) == (1024, 512)
    assert args.ignore_eos and args.trust_remote_code
    assert (args.host, args.port, args.backend) == ("0.0.0.0", 8000, "vllm")
    assert args.num_prompts == 30  # --num-prompt is a prefix of --num-prompts
    assert args.request_rate == float("inf")
