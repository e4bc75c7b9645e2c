"""A real `vllm serve` process for the OpenAI server tests, and helpers around it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> list[str]:
    """The installed `vllm` console script next to this Python, else `python -m`."""
    script = Path(sys.executable).parent / "vllm"
    if script.is_file():
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def process_alive(pid: int) -> bool:
    """True when `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def alive_after(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """The pids still alive once they all exited or timeout_s passed (a hang check)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if process_alive(p)]
        if not alive or time.monotonic() > deadline:
            return [(p, cmdline(p)) for p in alive]
        time.sleep(0.1)


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class RemoteServer:
    """`vllm serve ARGS` on a free local port; waits until /health answers 200.

    Raises RuntimeError with the server's log if it exits or does not come up in time.
    """

    def __init__(self, args: list[str], api_key: str | None = None,
                 env: dict[str, str] | None = None, https: bool = False) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log_file = tempfile.NamedTemporaryFile(
            "w+", prefix="vllm-serve-", suffix=".log", delete=False
        )
        cmd = [*vllm_command(), "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            cmd, stdout=self.log_file, stderr=subprocess.STDOUT, cwd=REPO, env=full_env
        )
        self.base_url = f"{'https' if https else 'http'}://127.0.0.1:{self.port}"
        self._wait_healthy()
        self.engine_pid = self._engine_pid()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                # A test's TLS certificate is self-signed.
                if httpx.get(self.url("/health"), timeout=2, verify=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"vllm serve did not become healthy:\n{self.log()}")

    def _engine_pid(self) -> int:
        m = re.search(r"engine core pid (\d+)", self.log())
        assert m, self.log()
        return int(m.group(1))

    def log(self) -> str:
        """Everything the server printed so far."""
        return Path(self.log_file.name).read_text(errors="replace")

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> openai.OpenAI:
        """An official OpenAI client for this server (no retries, so errors show at once)."""
        kwargs.setdefault("timeout", 120)
        return openai.OpenAI(
            base_url=self.url("/v1"), api_key=self.api_key or "unused", max_retries=0, **kwargs
        )

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 120)
        return openai.AsyncOpenAI(
            base_url=self.url("/v1"), api_key=self.api_key or "unused", max_retries=0, **kwargs
        )

    def metrics_text(self) -> str:
        """The body of GET /metrics (Prometheus text format)."""
        return httpx.get(self.url("/metrics"), headers=self.headers(), timeout=10).text

    def metrics(self) -> dict[str, float]:
        """/metrics as {name{labels}: value}. On a server with one engine its `engine="0"`
        label is dropped, and then labels are dropped when only model_name is left."""
        text = self.metrics_text()
        single_engine = re.search(r'engine="[1-9]', text) is None
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            if single_engine:
                key = key.replace('engine="0",', "")
            key = re.sub(r'\{model_name="[^"]*"\}', "", key)
            out[key] = float(value)
        return out

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, float]:
        """Waits until the engine runs and holds nothing; returns the metrics then."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (
                m.get("vllm:num_requests_running") == 0
                and m.get("vllm:num_requests_waiting") == 0
                and m.get("vllm:num_requests_api_server") == 0
                and m.get("vllm:kv_cache_free_blocks") == m.get("vllm:kv_cache_total_blocks")
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        """Stops the server with `sig` (SIGKILL after timeout_s); returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[..., RemoteServer]]:
    """Starts RemoteServers for one test module and stops them (and their engines) after it."""
    servers: list[RemoteServer] = []

    def start(*args: str, api_key: str | None = None, env: dict[str, str] | None = None,
              https: bool = False):
        server = RemoteServer(list(args), api_key=api_key, env=env, https=https)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
        if process_alive(server.engine_pid):
            os.kill(server.engine_pid, signal.SIGKILL)
