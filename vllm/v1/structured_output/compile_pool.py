"""Compile checks in worker processes, so that a constraint past its time limit can be killed.

A compile cannot be interrupted inside a thread: a schema that compiles for two minutes would
hold its thread for two minutes after its request failed, and every structured request
behind it would wait. Here each check runs in a worker process that is killed at its deadline.

Layout. The owner (the API server) talks to one *supervisor* process (compile_supervisor.py)
over a pipe. The
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

import dataclasses
import itertools
import logging
import multiprocessing
import os
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from vllm.exceptions import GrammarCompileError, InvalidRequestError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.spawn import main_module_hidden

if TYPE_CHECKING:
    from vllm.config import StructuredOutputsConfig
    from vllm.v1.structured_output.backends.auto import CompileClock

__all__ = ["BackendChecker", "CompileCheckPool", "CompileAbortedError", "Checker"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_SHUTTING_DOWN = "structured outputs: the server is shutting down"


# What a check's outcome carries: nothing ("ok"), the typed request error ("invalid",
# "aborted"), or the text of an internal failure ("error").
Message = InvalidRequestError | str | None


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
        # Deferred: the supervisor's module imports this one.
        from vllm.v1.structured_output.compile_supervisor import supervisor_main

        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(
            target=supervisor_main,
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
    future: Future[float], status: str, message: Message, seconds: float
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
