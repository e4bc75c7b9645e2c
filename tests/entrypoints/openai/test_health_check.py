"""A worker process killed while the server is idle is noticed without any request: /health
turns 503 (or reports the engine degraded under -dp) and the metrics say so. Real mp workers
of `vllm serve demo-tiny`; the periodic check is far off, so the sentinels must tell."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from .conftest import cmdline, alive_after, descendants

MODEL = "demo-tiny"
# Bounds the wait for the server to notice; the check itself runs every couple of seconds.
DEADLINE_S = 60.0


def _worker_pids(engine_pid: int) -> list[int]:
    """The mp worker processes under one engine core (spawned children, not helpers such as
    multiprocessing's resource tracker)."""
    return [pid for pid in descendants(engine_pid)
            if "spawn_main" in cmdline(pid) and "resource_tracker" not in cmdline(pid)]


def _engine_pids(server) -> list[int]:
    m = re.search(r"engine core pid ([\d, ]+)\)", server.log())
    assert m, server.log()
    return [int(pid) for pid in m.group(1).split(", ")]


def _poll_health(server, done, deadline_s: float = DEADLINE_S) -> httpx.Response:
    """GETs /health until `done(response)` or the deadline; returns the last response."""
    deadline = time.monotonic() + deadline_s
    while True:
        r = httpx.get(server.url("/health"), timeout=10)
        if done(r) or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def _assert_clean(text: str) -> None:
    assert "Traceback" not in text and "\x1b[" not in text, text
    assert "\n" not in text, text


@pytest.fixture(scope="module")
def server(start_server):
    # A periodic check far beyond the test's wait: only the workers' sentinels can tell.
    return start_server(MODEL, "--distributed-executor-backend", "mp", "--max-model-len", "512",
                        "--disable-log-requests", "--health-check-interval", "600")


def test_a_worker_killed_while_idle_turns_health_503(server) -> None:
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    workers = _worker_pids(server.engine_pid)
    assert len(workers) == 1, [(p, cmdline(p)) for p in descendants(server.engine_pid)]
    os.kill(workers[0], signal.SIGKILL)

    r = _poll_health(server, lambda r: r.status_code != 200, deadline_s=15.0)
    assert r.status_code == 503, "the dead worker was not noticed at once without traffic"
    message = r.json()["error"]["message"]
    assert "worker rank 0" in message and "SIGKILL" in message, message
    _assert_clean(r.text)

    m = server.metrics()
    assert m["vllm:engine_alive"] == 0 and m["vllm:engine_dead_total"] == 1
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0

    r = httpx.post(server.url("/v1/completions"), timeout=10,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert r.status_code == 503
    _assert_clean(r.json()["error"]["message"])

    children = descendants(server.proc.pid)
    assert server.stop(signal.SIGTERM, timeout_s=30) == 0
    assert alive_after(children) == []


def test_data_parallel_marks_the_engine_degraded_and_routes_around_it(start_server) -> None:
    dp = start_server(MODEL, "-dp", "2", "--distributed-executor-backend", "mp",
                      "--max-model-len", "512", "--disable-log-requests")
    first, second = _engine_pids(dp)
    workers = _worker_pids(first)
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)

    r = _poll_health(dp, lambda r: r.status_code != 200 or bool(r.content))
    assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
    assert list(r.json()["dead_engines"]) == ["0"]
    _assert_clean(r.json()["dead_engines"]["0"])

    # Engine 0 is idle and would win the routing; every request must reach engine 1.
    for _ in range(3):
        r = httpx.post(dp.url("/v1/completions"), timeout=60,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
    m = dp.metrics()
    assert m["vllm:engine_dead_total"] == 1 and m["vllm:engine_alive"] == 1
    routed = {k: v for k, v in m.items() if k.startswith("vllm:data_parallel_requests_routed")}
    assert sorted(routed.values()) == [0, 3], routed
    assert second in _engine_pids(dp)


def _ray_worker_pids(root: int) -> list[int]:
    """Processes that host a RayWorker actor (Ray retitles them `ray::RayWorker...`) and that
    belong to this server's process tree."""
    return [pid for pid in descendants(root) if cmdline(pid).startswith("ray::RayWorker")]


@pytest.mark.timeout(600)
def test_a_ray_actor_killed_while_idle_turns_health_503(start_server, tmp_path) -> None:
    """Also: the local Ray cluster the server started leaves the user's Ray as it was (no
    token in ~/.ray, no session directory)."""
    pytest.importorskip("ray", reason="the ray extra is part of the test extra")
    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("needs the local cluster the server starts itself, not RAY_ADDRESS")
    home = tmp_path / "home"
    home.mkdir()
    # Short, so the cluster's socket paths fit in it (a long one would send it to /tmp).
    tmp = Path(tempfile.mkdtemp(prefix="vh", dir="/tmp"))
    # A periodic check far beyond the test's wait: the actor's death must wake the engine.
    server = start_server(MODEL, "--distributed-executor-backend", "ray", "--max-model-len",
                          "512", "--disable-log-requests", "--health-check-interval", "600",
                          env={"HOME": str(home), "TMPDIR": str(tmp)})
    deadline = time.monotonic() + DEADLINE_S
    while not (actors := _ray_worker_pids(server.proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(actors) == 1, [(p, cmdline(p)) for p in descendants(server.proc.pid)]
    os.kill(actors[0], signal.SIGKILL)

    r = _poll_health(server, lambda r: r.status_code != 200, deadline_s=15.0)
    assert r.status_code == 503, "the dead actor was not noticed at once without traffic"
    message = r.json()["error"]["message"]
    assert "RayExecutor: worker rank 0" in message, message
    _assert_clean(r.text)
    assert server.metrics()["vllm:engine_dead_total"] == 1

    children = descendants(server.proc.pid)
    assert server.stop(signal.SIGTERM, timeout_s=60) == 0
    assert alive_after(children) == []
    assert not (home / ".ray").exists(), list((home / ".ray").iterdir())
    assert not list(tmp.glob("vllm-ray-*")), "the local cluster's directory was left behind"
    shutil.rmtree(tmp, ignore_errors=True)

