"""The module entry points upstream vLLM users run: `python -m vllm.entrypoints.cli.main` is
the `vllm` command, and `python -m vllm.entrypoints.openai.api_server --model M [flags]` serves
like `vllm serve M [flags]`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.utils_wait import wait_until
from vllm.entrypoints.openai import api_server

REPO = Path(__file__).resolve().parents[3]
MODEL = "demo-tiny"
API_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
CLI_MAIN = [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=_env())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_api_server_module_help() -> None:
    result = run([*API_SERVER, "--help"])
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert text.startswith("usage: python -m vllm.entrypoints.openai.api_server")
    for flag in ("--model", "--port", "--tensor-parallel-size", "-tp", "-pp",
                 "--distributed-executor-backend {mp,ray,uni}", "--trust-remote-code",
                 "--disable-log-requests", "Same as `vllm serve`"):
        assert flag in text, flag


def test_cli_main_module_is_the_vllm_command() -> None:
    result = run([*CLI_MAIN, "--help"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: vllm")
    assert "serve" in result.stdout and "bench" in result.stdout


def test_api_server_refuses_unknown_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        api_server.main(["--model", MODEL, "--cpu-offload-gb", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m vllm.entrypoints.openai.api_server: error: unsupported "
                          "option --cpu-offload-gb")
    assert "usage:" not in err


def test_api_server_reports_config_errors_like_serve(capsys: pytest.CaptureFixture[str]) -> None:
    assert api_server.main(["--model", MODEL, "-tp=3", "--port", "0"]) == 2
    assert "--tensor-parallel-size 3: the model's 4 attention heads" in capsys.readouterr().err
    assert api_server.main(["--model", MODEL, "--max_model_len=-5", "--port", "0"]) == 2
    assert "--max-model-len" in capsys.readouterr().err
    assert api_server.main(["--model", MODEL, "--send-timeout", "-1", "--port", "0"]) == 2
    assert "--send-timeout: must be at least 0 seconds" in capsys.readouterr().err


def _group_gone(pgid: int, timeout: float = 10.0) -> bool:
    """True once no process of group `pgid` is left (the workers' own exits may lag their
    parent's by a moment)."""
    def gone() -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return False

    return wait_until(gone, timeout, interval_s=0.1)


@pytest.mark.slow
def test_api_server_module_serves(tmp_path: Path) -> None:
    """The flags of upstream's `-pp 2 -tp 2` report (four ranks, a --max-model-len past the
    model's positions under VLLM_ALLOW_LONG_MAX_MODEL_LEN): a completion, then Ctrl-C exits
    cleanly and leaves no worker and no socket directory behind."""
    port = free_port()
    cmd = [*API_SERVER, "--model", MODEL, "--enforce-eager", f"--port={port}",
           "--host", "127.0.0.1", "-pp", "2", "--distributed_executor_backend=mp",
           "--trust-remote-code", "--gpu-memory-util=0.9", "--no-enable-prefix-caching",
           "--max-num-batched-tokens=8192", "--disable-log-requests", "--max-model-len=8192",
           "--block-size", "64", "--dtype=float16", "-tp=2"]
    log = tmp_path / "server.log"
    env = {**_env(), "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "TMPDIR": str(tmp_path)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(healthy, timeout_s=240, interval_s=0.25), log.read_text()
        models = httpx.get(base + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        response = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True,
        })
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
        assert "vLLM API server shut down" in log.read_text()
        assert "Traceback" not in log.read_text()
        assert not list(tmp_path.glob("vllm-mp-*")), "the socket directory was left behind"
        assert _group_gone(proc.pid), "a process of the server's group outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
