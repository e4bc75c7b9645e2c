"""The supervisor process of the compile-check pool (compile_pool.py): it prepares the checker
once, forks warm workers from itself, hands each check to an idle worker, and kills a worker
whose check runs past its deadline. Runs only in the process the pool spawns."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import multiprocessing
import os
import signal
import sys
import time
import warnings
from collections import deque
from multiprocessing.connection import Connection, wait

from vllm.exceptions import InvalidRequestError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.compile_pool import (
    _PR_SET_PDEATHSIG,
    Checker,
    CompileAbortedError,
    Message,
)

logger = logging.getLogger(__name__)


def supervisor_main(
    conn: Connection, checker: Checker, num_workers: int, timeout_s: float, slow_after_s: float
) -> None:
    """Entry point of the supervisor process (spawned)."""
    # Ctrl-C reaches the whole process group; the owner decides when checks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        checker.prepare()
    except BaseException as e:  # reported to the owner, which fails its checks with it
        with contextlib.suppress(OSError):
            conn.send(("broken", f"{type(e).__name__}: {e}"))
        return
    _Supervisor(conn, checker, num_workers, timeout_s, slow_after_s).run()


@dataclasses.dataclass
class _Worker:
    pid: int
    conn: Connection
    ready: bool = False
    # The check it runs: (job id, constraint kind, small), when it started, its deadline.
    job: tuple[int, str, bool] | None = None
    started: float = 0.0
    deadline: float = 0.0
    # While the check's clock is paused: the seconds it had left (deadline is then inf).
    left_s: float | None = None


class _Supervisor:
    """The supervisor's single-threaded loop: queues, dispatch, deadlines, forks."""

    def __init__(
        self,
        conn: Connection,
        checker: Checker,
        num_workers: int,
        timeout_s: float,
        slow_after_s: float,
    ) -> None:
        self.conn = conn
        self.checker = checker
        self.num_workers = num_workers
        self.max_processes = 2 * num_workers
        # Big constraints never hold every regular slot: one stays free for small ones.
        self.max_big = max(1, num_workers - 1)
        self.timeout_s = timeout_s
        self.slow_after_s = slow_after_s
        self.small: deque[tuple[int, StructuredOutputsParams]] = deque()
        self.big: deque[tuple[int, StructuredOutputsParams]] = deque()
        self.workers: dict[int, _Worker] = {}

    def run(self) -> None:
        try:
            while True:
                self._expire(time.monotonic())
                self._dispatch(time.monotonic())
                by_conn = {w.conn: w for w in self.workers.values()}
                ready = wait([self.conn, *by_conn], self._wakeup(time.monotonic()))
                for c in ready:
                    if c is self.conn:
                        if not self._from_owner():
                            return
                    elif (worker := by_conn[c]).pid in self.workers:
                        if not self._from_worker(worker):
                            return
        finally:
            for worker in list(self.workers.values()):
                self._kill(worker)

    # -- messages

    def _from_owner(self) -> bool:
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            return False  # the owner is gone
        if msg[0] == "check":
            _, job_id, params, small = msg
            (self.small if small else self.big).append((job_id, params))
        elif msg[0] == "cancel":
            self._cancel(msg[1])
        elif msg[0] == "stop":
            return False
        return True

    def _from_worker(self, worker: _Worker) -> bool:
        """Handles one message of a worker; False when the supervisor must stop."""
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            self._lost(worker)
            return True
        if msg[0] == "ready":
            worker.ready = True
            return True
        if msg[0] == "broken":
            # Every fork starts from the same state, so every worker would fail the same way:
            # hand the reason to the owner rather than forking forever.
            with contextlib.suppress(OSError):
                self.conn.send(msg)
            return False
        if msg[0] in ("pause", "resume"):
            if worker.job is not None and worker.job[0] == msg[1]:
                now = time.monotonic()
                if msg[0] == "pause" and worker.left_s is None:
                    worker.left_s = worker.deadline - now
                    worker.deadline = math.inf
                elif msg[0] == "resume" and worker.left_s is not None:
                    worker.deadline = now + worker.left_s
                    worker.left_s = None
            return True
        job_id, status, message, seconds = msg
        if worker.job is not None and worker.job[0] == job_id:
            worker.job = None
            worker.left_s = None
            self._report(job_id, status, message, seconds)
        return True

    def _report(self, job_id: int, status: str, message: Message, seconds: float) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("done", job_id, status, message, seconds))

    def _cancel(self, job_id: int) -> None:
        for lane in (self.small, self.big):
            for item in lane:
                if item[0] == job_id:
                    lane.remove(item)
                    return
        for worker in list(self.workers.values()):
            if worker.job is not None and worker.job[0] == job_id:
                self._kill(worker)  # frees its capacity now; the owner expects no answer

    # -- workers

    def _expire(self, now: float) -> None:
        for worker in list(self.workers.values()):
            if worker.job is not None and now >= worker.deadline:
                job_id, kind, _ = worker.job
                self._kill(worker)
                self._report(
                    job_id,
                    "aborted",
                    CompileAbortedError.timed_out(kind, self.timeout_s),
                    now - worker.started,
                )

    def _lost(self, worker: _Worker) -> None:
        """A worker exited on its own: a crash (or the kernel killed it) while checking."""
        job = worker.job
        status = self._kill(worker)
        if job is not None:
            self._report(
                job[0],
                "aborted",
                CompileAbortedError(
                    f"structured_outputs.{job[1]}",
                    f"compiling the grammar crashed its worker ({status}); the constraint is "
                    "too large or too complex",
                ),
                time.monotonic() - worker.started,
            )

    def _kill(self, worker: _Worker) -> str:
        """Kills and reaps a worker; returns how it ended."""
        self.workers.pop(worker.pid, None)
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGKILL)
        status = "exited"
        with contextlib.suppress(ChildProcessError):
            _, code = os.waitpid(worker.pid, 0)
            if os.WIFSIGNALED(code):
                status = f"killed by signal {os.WTERMSIG(code)}"
            else:
                status = f"exit code {os.WEXITSTATUS(code)}"
        worker.conn.close()
        return status

    def _young(self, now: float) -> list[_Worker]:
        return [
            w for w in self.workers.values()
            if w.job is not None and now - w.started < self.slow_after_s
        ]

    def _dispatch(self, now: float) -> None:
        while self.small or self.big:
            young = self._young(now)
            if len(young) >= self.num_workers:
                return
            if self.small:
                lane = self.small
            elif sum(1 for w in young if not w.job[2]) < self.max_big:
                lane = self.big
            else:
                return
            worker = next((w for w in self.workers.values() if w.ready and w.job is None), None)
            if worker is None:
                starting = any(not w.ready for w in self.workers.values())
                if not starting and len(self.workers) < self.max_processes:
                    self._fork()
                return  # dispatched once the new worker says it is ready
            job_id, params = lane.popleft()
            try:
                worker.conn.send((job_id, params))
            except OSError:
                lane.appendleft((job_id, params))
                self._lost(worker)
                continue
            worker.job = (job_id, params.kind, lane is self.small)
            worker.started = now
            worker.deadline = now + self.timeout_s
        # Idle extra workers (forked while others were slow) are not kept.
        idle = [w for w in self.workers.values() if w.ready and w.job is None]
        while idle and len(self.workers) > self.num_workers:
            self._kill(idle.pop())

    def _wakeup(self, now: float) -> float | None:
        """Seconds until the next deadline, or until a running check turns slow while
        others wait (then a new worker may be started)."""
        times = [w.deadline for w in self.workers.values()
                 if w.job is not None and w.left_s is None]
        if self.small or self.big:
            times += [w.started + self.slow_after_s for w in self._young(now)]
        return max(0.0, min(times) - now) if times else None

    def _fork(self) -> None:
        ours, theirs = multiprocessing.Pipe()
        supervisor = os.getpid()
        with warnings.catch_warnings():
            # Newer Pythons warn about forking with native threads alive (torch starts one at
            # import); the worker touches neither torch nor anything those threads hold.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                ours.close()
                self.conn.close()
                for other in self.workers.values():
                    other.conn.close()
                _die_with(supervisor)
                try:
                    self.checker.start_worker()
                except Exception as e:
                    theirs.send(("broken", f"{type(e).__name__}: {e}"))
                    raise
                _worker_loop(theirs, self.checker)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        self.workers[pid] = _Worker(pid, ours)


def _die_with(parent_pid: int) -> None:
    """Asks Linux to kill this process when its parent exits (elsewhere: a no-op)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _worker_loop(conn: Connection, checker: Checker) -> None:
    conn.send(("ready",))
    while True:
        try:
            job_id, params = conn.recv()
        except (EOFError, OSError):
            return
        start = time.perf_counter()
        try:
            checker.check(params, _DeadlineClock(conn, job_id))
            status, message = "ok", None
        except InvalidRequestError as e:
            # Sent as the exception itself (it pickles by its fields), so the owner re-raises
            # it with its type and `param` intact.
            status, message = "invalid", e
        except Exception as e:  # a compiler bug must fail this check, not the worker
            status = "error"
            message = f"structured_outputs.{params.kind}: compiling the grammar failed: {e!r}"
        conn.send((job_id, status, message, time.perf_counter() - start))


@dataclasses.dataclass
class _DeadlineClock:
    """A worker's check clock: tells the supervisor to stop and restart the deadline."""

    conn: Connection
    job_id: int

    def pause(self) -> None:
        self.conn.send(("pause", self.job_id))

    def resume(self) -> None:
        self.conn.send(("resume", self.job_id))
