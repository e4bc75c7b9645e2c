"""Compile checks in worker processes, so that a constraint past its time limit can be killed.

A compile cannot be interrupted inside a thread: a schema that compiles for two minutes would
hold its thread for two minutes after its request failed, and every structured request
behind it would wait. Here each check runs in a worker process that is killed at its deadline.

Layout. The owner (the API server) talks to one *supervisor* process over a pipe. The
supervisor is spawned on the first check; it imports xgrammar and prepares the vocabulary
once (seconds), then forks workers from itself: a fork takes milliseconds and shares that
memory, so a killed worker is replaced at once and idle ones stay warm. The supervisor never
compiles: it queues checks, hands each to an idle worker, and kills a worker whose check runs
past its deadline.

Scheduling, so that one constraint cannot starve the others:
- the deadline starts when a worker takes the check: waiting in the queue never counts,
  nor does a worker's building of a backend on its first use (the deadline stops);
- small constraints are taken before big ones, and big ones never hold every worker;
- at most `num_workers` checks run at once, but a check running longer than `slow_after_s`
  stops counting against that: the next check gets a fresh worker rather than waiting behind
  it (at most twice `num_workers` processes in all);
- a cancelled check leaves the queue, or its worker is killed.

Needs `os.fork` (Linux, macOS); the owner falls back to in-process compiles without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import logging
import math
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Protocol

from vllm.exceptions import GrammarCompileError, InvalidRequestError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.process import main_module_hidden

if TYPE_CHECKING:
    from vllm.config import StructuredOutputsConfig
    from vllm.v1.structured_output.backends.auto import CompileClock

__all__ = ["BackendChecker", "CompileCheckPool", "CompileAbortedError", "Checker"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_SHUTTING_DOWN = "structured outputs: the server is shutting down"


# What a check's outcome carries: nothing ("ok"), the typed request error ("invalid",
# "aborted"), or the text of an internal failure ("error").
_Message = InvalidRequestError | str | None


class CompileAbortedError(GrammarCompileError):
    """A compile was stopped: it ran past its time limit, or its worker died. Depends on the
    load as much as on the constraint, so it is never remembered as the constraint's verdict."""

    @classmethod
    def timed_out(cls, kind: str, timeout_s: float) -> CompileAbortedError:
        """The error of a `kind` constraint whose compile ran past `timeout_s` seconds."""
        return cls(
            f"structured_outputs.{kind}",
            f"compiling the grammar took longer than {timeout_s:g} s "
            "(--structured-outputs-config.compile_timeout_s)",
        )


class Checker(Protocol):
    """What the workers run. Pickled to the supervisor, which forks the workers."""

    def prepare(self) -> None:
        """Runs once in the supervisor before any worker is forked (may take seconds).
        Must not leave threads running: workers are forked from the supervisor."""

    def start_worker(self) -> None:
        """Runs once in each worker right after the fork, before its first check."""

    def check(self, params: StructuredOutputsParams, clock: CompileClock) -> None:
        """Compiles `params`; raises InvalidRequestError (usually GrammarCompileError) naming
        the field when it is invalid. `clock.pause()` ... `clock.resume()` brackets a wait that
        is no constraint's cost (building a backend): the deadline stops meanwhile."""


@dataclasses.dataclass
class BackendChecker:
    """Checks constraints with a backend identical to the engine's (same configuration)."""

    tokenizer: str
    vocab_size: int
    stop_token_ids: list[int]
    config: StructuredOutputsConfig
    max_threads: int | None = None
    # Each worker's compiled-grammar cache (repeated schemas are then checked in microseconds).
    cache_limit_bytes: int = 64 * 1024 * 1024

    def prepare(self) -> None:
        """Loads the tokenizer and runs each selected backend's `prepare` (xgrammar's vocabulary
        view: seconds)."""
        # The Rust tokenizer's thread pool must not exist when workers are forked.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from vllm.transformers_utils.tokenizer import get_tokenizer
        from vllm.v1.structured_output.backends.auto import prepare_backends

        self._tokenizer = get_tokenizer(self.tokenizer)
        self._prepared = prepare_backends(
            self.config, self._tokenizer, self.vocab_size, self.stop_token_ids
        )

    def start_worker(self) -> None:
        """Builds this worker's backend (milliseconds; llguidance's on first use)."""
        from vllm.v1.structured_output.backends.auto import create_backend

        self._backend = create_backend(
            self.config,
            self._tokenizer,
            self.vocab_size,
            self.stop_token_ids,
            prepared=self._prepared,
            max_threads=self.max_threads,
            cache_limit_bytes=self.cache_limit_bytes,
        )

    def check(self, params: StructuredOutputsParams, clock: CompileClock) -> None:
        """Compiles `params` and checks its first step. Raises ValueError naming the field."""
        self._backend.compile_choosing(params, clock=clock)


class CompileCheckPool:
    """Runs `checker.check` in killable worker processes, each within `timeout_s` seconds.

    Thread-safe. Nothing starts until the first `submit`.
    """

    def __init__(
        self,
        checker: Checker,
        num_workers: int,
        timeout_s: float,
        slow_after_s: float | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers: must be at least 1, got {num_workers}")
        self._checker = checker
        self._num_workers = num_workers
        self._timeout_s = timeout_s
        self._slow_after_s = slow_after_s if slow_after_s is not None else min(1.0, timeout_s / 2)
        self._lock = threading.Lock()
        self._link: _Link | None = None
        self._broken: str | None = None
        self._closed = False
        self._ids = itertools.count()

    @property
    def supervisor_pid(self) -> int | None:
        """The supervisor's process id while it runs (for diagnostics and tests)."""
        link = self._link
        return link.proc.pid if link is not None else None

    def submit(self, params: StructuredOutputsParams, *, small: bool) -> Future[float]:
        """Queues a check of `params`; returns a future of the compile's duration in seconds.

        The future raises ValueError when the constraint is invalid, CompileAbortedError (a
        ValueError) when its compile ran past the time limit or crashed its worker, and
        RuntimeError when the pool cannot run checks (its supervisor failed to start or died).
        Cancelling the future drops the check (killing its worker when it already runs).
        `small` constraints are taken first. Raises RuntimeError after `shutdown`.
        """
        future: Future[float] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("CompileCheckPool: used after shutdown")
            if self._broken is not None:
                future.set_exception(RuntimeError(self._broken))
                return future
            link = self._link if self._link is not None else self._start()
            job_id = next(self._ids)
            link.pending[job_id] = future
            link.outbox.put(("check", job_id, params, small))
        future.add_done_callback(lambda f: f.cancelled() and self._cancel(link, job_id))
        return future

    def _cancel(self, link: _Link, job_id: int) -> None:
        with self._lock:
            if link.pending.pop(job_id, None) is not None:
                link.outbox.put(("cancel", job_id))

    def _start(self) -> _Link:
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(
            target=_supervisor_main,
            args=(theirs, self._checker, self._num_workers, self._timeout_s, self._slow_after_s),
            name="vllm-grammar-check",
            # multiprocessing terminates it when this process exits normally; if this process
            # dies, the supervisor sees its pipe close and exits.
            daemon=True,
        )
        with main_module_hidden():
            proc.start()
        theirs.close()
        link = _Link(proc, ours)
        threading.Thread(
            target=self._receive, args=(link,), name="grammar-check-recv", daemon=True
        ).start()
        threading.Thread(
            target=_send_loop, args=(link,), name="grammar-check-send", daemon=True
        ).start()
        self._link = link
        return link

    def _receive(self, link: _Link) -> None:
        """Resolves futures from the supervisor's messages until it exits."""
        broken: str | None = None
        while True:
            try:
                msg = link.conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "broken":
                broken = f"structured outputs: the compile workers cannot start: {msg[1]}"
                continue
            if msg[0] != "done":
                continue
            _, job_id, status, message, seconds = msg
            with self._lock:
                future = link.pending.pop(job_id, None)
            if future is not None:
                _settle(future, status, message, seconds)
        link.join(5)
        with self._lock:
            pending, link.pending = link.pending, {}
            if self._link is link:
                self._link = None
            if broken is not None:
                # Starting again would fail the same way (a tokenizer that does not load).
                self._broken = broken
        if self._closed:
            reason = _SHUTTING_DOWN
        else:
            reason = broken or (
                f"structured outputs: the compile-check process exited (exit code "
                f"{link.proc.exitcode}); the next request starts a new one"
            )
            if pending:
                logger.error("%s", reason)
        for future in pending.values():
            _settle(future, "error", reason, 0.0)
        link.outbox.put(None)

    def shutdown(self) -> None:
        """Stops the supervisor and its workers; pending checks fail with RuntimeError.

        Idempotent. Waits at most a few seconds.
        """
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
        if link is None:
            return
        link.outbox.put(("stop",))
        link.outbox.put(None)
        if not link.join(2):
            # Still starting (it reads its pipe only once ready): its workers, if any, die
            # with it (they ask the kernel for that).
            link.proc.kill()
            link.join(5)
        with self._lock:
            pending, link.pending = link.pending, {}
        for future in pending.values():
            _settle(future, "error", _SHUTTING_DOWN, 0.0)


@dataclasses.dataclass
class _Link:
    """One supervisor process and what the owner keeps about it."""

    proc: Any
    conn: Connection
    pending: dict[int, Future[float]] = dataclasses.field(default_factory=dict)
    # Messages to the supervisor, sent by one thread: a send blocks while the supervisor is
    # still starting, and submit must never block.
    outbox: queue.SimpleQueue[Any] = dataclasses.field(default_factory=queue.SimpleQueue)
    # The receiver and shutdown may both wait for the process; one reaps it.
    join_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def join(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the process to exit; True once it has."""
        with self.join_lock:
            self.proc.join(timeout_s)
            return self.proc.exitcode is not None


def _send_loop(link: _Link) -> None:
    while True:
        msg = link.outbox.get()
        if msg is None:
            return
        try:
            link.conn.send(msg)
        except (OSError, ValueError):
            return  # the supervisor is gone; the receiver fails what is pending


def _settle(
    future: Future[float], status: str, message: _Message, seconds: float
) -> None:
    """Completes `future` from a check's outcome (no-op when it was cancelled meanwhile)."""
    try:
        if status == "ok":
            future.set_result(seconds)
        elif status in ("invalid", "aborted"):
            # The worker or supervisor built the typed error (GrammarCompileError,
            # CompileAbortedError); it crossed the pipe by pickle.
            assert isinstance(message, InvalidRequestError)
            future.set_exception(message)
        else:
            future.set_exception(RuntimeError(message))
    except InvalidStateError:
        pass


# ---------------------------------------------------------------------- supervisor process


def _supervisor_main(
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

    def _report(self, job_id: int, status: str, message: _Message, seconds: float) -> None:
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
