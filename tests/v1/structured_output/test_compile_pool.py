"""CompileCheckPool: deadlines that count only the compile, killed and replaced workers, small
checks ahead of big ones, slow checks that stop holding capacity, crashes, cancellation,
supervisor death and shutdown. Uses a scripted stand-in checker (no xgrammar)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest
from v1.structured_output.pool_checkers import ScriptChecker

from tests.utils_wait import wait_until

from vllm.exceptions import GrammarCompileError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.compile_pool import CompileAbortedError, CompileCheckPool

RESULT_TIMEOUT_S = 60.0


def _params(script: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=script)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    return wait_until(lambda: not _alive(pid), timeout_s, interval_s=0.02)


def _wait_pid(path: Path, timeout_s: float = 30.0) -> int:
    assert wait_until(lambda: path.exists() and bool(path.read_text()), timeout_s,
                      interval_s=0.02), f"no worker wrote {path}"
    return int(path.read_text())


@pytest.fixture
def make_pool() -> Iterator[Callable[..., CompileCheckPool]]:
    pools: list[CompileCheckPool] = []

    def make(
        num_workers: int = 2, timeout_s: float = 30.0, slow_after_s: float = 60.0, **checker: Any
    ) -> CompileCheckPool:
        pool = CompileCheckPool(ScriptChecker(**checker), num_workers, timeout_s, slow_after_s)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.shutdown()


def test_outcomes(make_pool: Callable[..., CompileCheckPool]) -> None:
    pool = make_pool()
    assert pool.supervisor_pid is None  # nothing runs before the first check
    assert pool.submit(_params("ok"), small=True).result(RESULT_TIMEOUT_S) >= 0.0
    with pytest.raises(GrammarCompileError, match=r"^structured_outputs\.regex: nope$") as info:
        pool.submit(_params("bad=nope"), small=True).result(RESULT_TIMEOUT_S)
    # The error crossed two pipes by pickle with its type and fields intact.
    assert (info.value.param, info.value.message) == ("structured_outputs.regex", "nope")
    with pytest.raises(RuntimeError, match="compiling the grammar failed: RuntimeError"):
        pool.submit(_params("boom"), small=False).result(RESULT_TIMEOUT_S)


def test_overdue_check_is_killed_and_replaced(
    make_pool: Callable[..., CompileCheckPool], tmp_path: Path
) -> None:
    pool = make_pool(timeout_s=0.5)
    slow = pool.submit(_params(f"pid={tmp_path / 'slow'};sleep=120"), small=False)
    with pytest.raises(CompileAbortedError, match="took longer than 0.5 s"):
        slow.result(RESULT_TIMEOUT_S)
    # Its worker is gone: it no longer holds a CPU or a slot.
    assert _wait_gone(int((tmp_path / "slow").read_text()))
    assert pool.submit(_params("ok"), small=False).result(RESULT_TIMEOUT_S) >= 0.0


def test_waiting_for_a_worker_does_not_count(
    make_pool: Callable[..., CompileCheckPool],
) -> None:
    # Two workers: big checks get one of them, so these run one after another and the last
    # waits 1.8 s, longer than the limit, before its 0.6 s compile.
    pool = make_pool(num_workers=2, timeout_s=1.5)
    futures = [pool.submit(_params("sleep=0.6"), small=False) for _ in range(4)]
    for future in futures:
        assert future.result(RESULT_TIMEOUT_S) >= 0.5


def test_building_a_backend_does_not_count(make_pool: Callable[..., CompileCheckPool]) -> None:
    """A worker's first fallback check builds that backend (llguidance: over a second): the
    deadline stops meanwhile, and counts on from where it stopped."""
    # 0.4 s of compile against a 0.8 s limit: room for a loaded machine's scheduling delays
    # (sleeps only ever last longer, so the second check always overruns).
    pool = make_pool(timeout_s=0.8)
    assert pool.submit(_params("sleep=0.2;build=1.0;sleep=0.2"), small=True).result(
        RESULT_TIMEOUT_S) >= 1.4
    with pytest.raises(CompileAbortedError, match="took longer than 0.8 s"):
        pool.submit(_params("sleep=0.5;build=0.1;sleep=0.5"), small=True).result(
            RESULT_TIMEOUT_S)


def test_small_checks_do_not_wait_behind_big_ones(
    make_pool: Callable[..., CompileCheckPool],
) -> None:
    pool = make_pool(num_workers=2)
    big = [pool.submit(_params("sleep=120"), small=False) for _ in range(3)]
    small = [pool.submit(_params("ok"), small=True) for _ in range(3)]
    for future in small:
        future.result(RESULT_TIMEOUT_S)
    assert not any(f.done() for f in big)


def test_slow_checks_stop_holding_capacity(
    make_pool: Callable[..., CompileCheckPool],
) -> None:
    # One worker, but a check running longer than slow_after_s no longer counts against it.
    pool = make_pool(num_workers=1, slow_after_s=0.2)
    slow = pool.submit(_params("sleep=120"), small=False)
    late = pool.submit(_params("ok"), small=False)
    assert late.result(RESULT_TIMEOUT_S) >= 0.0
    assert not slow.done()


def test_crash_fails_only_that_check(make_pool: Callable[..., CompileCheckPool]) -> None:
    pool = make_pool()
    with pytest.raises(CompileAbortedError, match=r"crashed its worker \(exit code 3\)"):
        pool.submit(_params("crash"), small=True).result(RESULT_TIMEOUT_S)
    assert pool.submit(_params("ok"), small=True).result(RESULT_TIMEOUT_S) >= 0.0


def test_cancel_kills_a_running_check(
    make_pool: Callable[..., CompileCheckPool], tmp_path: Path
) -> None:
    pool = make_pool(num_workers=1)
    running = pool.submit(_params(f"pid={tmp_path / 'run'};sleep=120"), small=False)
    queued = pool.submit(_params("sleep=120"), small=False)
    pid = _wait_pid(tmp_path / "run")
    assert queued.cancel()
    assert running.cancel()
    assert _wait_gone(pid)
    with pytest.raises(CancelledError):
        running.result(0)
    # The queued one was dropped, so the only worker slot is free for this one.
    assert pool.submit(_params("ok"), small=False).result(RESULT_TIMEOUT_S) >= 0.0


@pytest.mark.parametrize("failure", ["prepare_error", "start_error"])
def test_workers_that_cannot_start_fail_checks(
    make_pool: Callable[..., CompileCheckPool], failure: str
) -> None:
    pool = make_pool(**{failure: "no tokenizer here"})
    with pytest.raises(RuntimeError, match="cannot start: OSError: no tokenizer here"):
        pool.submit(_params("ok"), small=True).result(RESULT_TIMEOUT_S)
    # Remembered: the next check fails at once instead of starting another supervisor.
    assert wait_until(lambda: pool.supervisor_pid is None, RESULT_TIMEOUT_S, interval_s=0.02)
    future = pool.submit(_params("ok"), small=True)
    assert future.done()
    with pytest.raises(RuntimeError, match="no tokenizer here"):
        future.result(0)
    assert pool.supervisor_pid is None


def test_supervisor_death_fails_pending_checks_and_restarts(
    make_pool: Callable[..., CompileCheckPool], tmp_path: Path
) -> None:
    pool = make_pool()
    pending = pool.submit(_params(f"pid={tmp_path / 'w'};sleep=120"), small=True)
    worker = _wait_pid(tmp_path / "w")
    supervisor = pool.supervisor_pid
    os.kill(supervisor, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="compile-check process exited"):
        pending.result(RESULT_TIMEOUT_S)
    assert _wait_gone(worker)  # workers die with their supervisor
    assert pool.submit(_params("ok"), small=True).result(RESULT_TIMEOUT_S) >= 0.0
    assert pool.supervisor_pid not in (None, supervisor)


def test_shutdown_stops_every_process(
    make_pool: Callable[..., CompileCheckPool], tmp_path: Path
) -> None:
    pool = make_pool()
    pending = pool.submit(_params(f"pid={tmp_path / 'w'};sleep=120"), small=True)
    worker = _wait_pid(tmp_path / "w")
    supervisor = pool.supervisor_pid
    pool.shutdown()
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shutting down"):
        pending.result(RESULT_TIMEOUT_S)
    assert _wait_gone(worker)
    assert _wait_gone(supervisor)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(_params("ok"), small=True)


def test_owner_death_stops_everything(tmp_path: Path) -> None:
    # The owner (an API server) is killed outright: no shutdown runs, yet its supervisor sees
    # the pipe close and its workers die with the supervisor.
    script = f"""
import sys, time
from v1.structured_output.pool_checkers import ScriptChecker
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.compile_pool import CompileCheckPool
pool = CompileCheckPool(ScriptChecker(), 2, 60.0)
pool.submit(StructuredOutputsParams(regex="pid={tmp_path / 'w'};sleep=120"), small=True)
while not pool.supervisor_pid:
    time.sleep(0.01)
print(pool.supervisor_pid, flush=True)
time.sleep(600)
"""
    tests_dir = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests_dir.parent), str(tests_dir)]))
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        supervisor = int(owner.stdout.readline())
        worker = _wait_pid(tmp_path / "w")
        owner.kill()
        owner.wait(30)
        assert _wait_gone(supervisor)
        assert _wait_gone(worker)
    finally:
        owner.kill()
        owner.stdout.close()
