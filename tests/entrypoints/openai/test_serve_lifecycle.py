"""`vllm serve` startup and shutdown: clear startup errors, clean exit on SIGINT/SIGTERM with
no orphan processes, and the engine flags (async scheduling, mp workers, dotted config)."""

from __future__ import annotations

import signal
import socket
import subprocess

from vllm.entrypoints.cli.main import main

from .conftest import REPO, RemoteServer, alive_after, descendants, vllm_command

MODEL = "demo-tiny"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*vllm_command(), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_bad_flag_is_reported(capsys):
    assert main(["serve", MODEL, "--max-model-len", "-5"]) == 2
    assert "--max-model-len" in capsys.readouterr().err


def test_engine_startup_error_is_reported_not_hung():
    # run_cli's subprocess timeout is the hang check.
    result = run_cli("serve", MODEL, "--kv-cache-memory", "1", "--port", "0")
    assert result.returncode == 1
    assert "the engine failed to start" in result.stderr
    assert "--kv-cache-memory" in result.stderr


def test_port_in_use_is_reported(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        status = main(["serve", MODEL, "--host", "127.0.0.1", "--port", str(port)])
    assert status == 1
    assert "cannot listen" in capsys.readouterr().err


def test_async_scheduling_mp_workers_dotted_config_and_sigint():
    """Serves with the engine flags, then Ctrl-C stops the server, engine and workers.
    (SIGTERM is covered by test_engine_death.)"""
    server = RemoteServer([
        MODEL, "--max-model-len", "256", "--async-scheduling",
        "--distributed-executor-backend", "mp",
        "--structured-outputs-config.backend", "xgrammar",
        "--served-model-name", "my-model",
    ])
    try:
        assert f"http://127.0.0.1:{server.port}" in server.log()
        assert "serving model 'my-model'" in server.log()
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["my-model"]
        out = client.completions.create(model="my-model", prompt="Hi", max_tokens=6,
                                        extra_body={"guided_regex": "[0-9]{3}"})
        assert out.choices[0].text.isdigit() and len(out.choices[0].text) == 3
        stream = client.completions.create(model="my-model", prompt="Hi", max_tokens=5,
                                           temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in stream)
        full = client.completions.create(model="my-model", prompt="Hi", max_tokens=5,
                                         temperature=0)
        assert streamed == full.choices[0].text
        children = descendants(server.proc.pid)
        # engine core plus at least one worker process below it
        assert len(descendants(server.engine_pid)) >= 1
        assert server.stop(signal.SIGINT) == 0
        assert "shut down" in server.log()
        assert alive_after(children) == []
    finally:
        server.stop(signal.SIGKILL)
