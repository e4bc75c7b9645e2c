"""Workers in their own processes, driven over ZMQ sockets (`--distributed-executor-backend mp`)."""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import os
import shutil
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from vllm import thread_policy
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import ParallelLayout
from vllm.utils.temp_dirs import socket_dir
from vllm.v1.executor import worker_messages
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.mp_worker import WorkerProcSpec, run_worker
from vllm.v1.executor.worker_messages import Call, Failure, MessageDecodeError, Ready, Result
from vllm.v1.executor.worker_messages import RemoteError, Shutdown, WorkerMethod

# Seconds to wait for every worker to load its model and reply Ready.
_STARTUP_TIMEOUT_S = 600.0
# Seconds a worker gets to exit after being asked, before SIGTERM, then SIGKILL; shorter once
# a worker has died, since the others may be stuck waiting for it.
_EXIT_TIMEOUT_S = 5.0
_EXIT_AFTER_FAILURE_TIMEOUT_S = 0.5
# Seconds to wait for a worker whose sentinel fired to become reapable (for its exit code).
_REAP_TIMEOUT_S = 1.0
_TERMINATE_TIMEOUT_S = 2.0


def ipc_dir_prefix(pid: int) -> str:
    """The name prefix of the socket directories made by executors in process `pid` (the
    engine core's parent removes them if it has to kill that process)."""
    return f"vllm-mp-{pid}-"


def _make_ipc_dir() -> str:
    """A fresh private directory for the socket files (short enough for their paths)."""
    return socket_dir(ipc_dir_prefix(os.getpid()), max_len=80)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


@dataclass
class _Call:
    """One RPC awaiting its replies."""

    call_id: int
    future: Future
    # Ranks that must reply before the call is complete.
    waiting: set[int]
    # The rank whose result answers a call that is not gathered.
    output_rank: int
    # True: the result is the list of every rank's result; False: the output rank's result.
    gather: bool
    results: dict[int, Any] = field(default_factory=dict)
    error: BaseException | None = None

    def resolve(self) -> None:
        """Completes the future (error first, then the result)."""
        if self.future.done():
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        elif self.gather:
            self.future.set_result([self.results[r] for r in sorted(self.results)])
        else:
            self.future.set_result(self.results[self.output_rank])


# How long a worker whose sentinel fired may take to be reaped before it counts as alive.
REAP_WAIT_S = 2.0


def is_alive_confirmed(proc: Any, reap_wait_s: float = REAP_WAIT_S) -> bool:
    """Whether a worker process is alive, waiting up to reap_wait_s for one whose sentinel
    has fired: its exit closes the sentinel before the process can be reaped, and in that
    moment `is_alive()` still says True."""
    from multiprocessing.connection import wait

    if wait([proc.sentinel], timeout=0):
        proc.join(reap_wait_s)
    return proc.is_alive()


class _WorkerGroup:
    """The worker processes, their sockets, and the thread that reads their replies.

    Holds no reference to the executor, so the executor's finalizer can close it.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        world_size = vllm_config.parallel_config.world_size
        if world_size < 1:
            raise ValueError(f"parallel_config.world_size: must be at least 1, got {world_size}")
        self.world_size = world_size
        # The first rank of the last pipeline stage: it samples, so it answers the engine.
        pc = vllm_config.parallel_config
        self.output_rank = ParallelLayout(
            pc.tensor_parallel_size, pc.pipeline_parallel_size
        ).output_rank
        self.pids: list[int] = []
        self._lock = threading.Lock()
        # Held while a worker is reaped: the reader thread and the health check may reap the
        # same dead worker at once, and from two threads one waitpid fails before the other
        # has stored the exit code (the worker then looks alive, or "still running").
        self._reap_lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._order: deque[_Call] = deque()
        # Ids only match replies to calls (the order is _order's), so they are taken before
        # the lock is, and the call is encoded outside it.
        self._call_ids = itertools.count()
        self._error: str | None = None
        self._closed = False
        self._procs: list[multiprocessing.Process] = []
        self._reader: threading.Thread | None = None
        self._rpc: list[zmq.Socket] = []
        self._wake_r, self._wake_w = os.pipe()
        self.ipc_dir = _make_ipc_dir()
        self._ctx = zmq.Context(1)
        self._responses = self._ctx.socket(zmq.PULL)
        mp_ctx = multiprocessing.get_context("spawn")
        # The workers hold the read end; it reports EOF when this process exits in any way.
        death_reader, self._death_writer = mp_ctx.Pipe(duplex=False)
        try:
            self._responses.setsockopt(zmq.RCVHWM, 0)
            response_address = f"ipc://{self.ipc_dir}/responses"
            self._responses.bind(response_address)
            for rank in range(world_size):
                rpc_address = f"ipc://{self.ipc_dir}/rpc-{rank}"
                sock = self._ctx.socket(zmq.PUSH)
                self._rpc.append(sock)
                # Connecting (not binding) creates the pipe at once, so a send queues instead
                # of blocking even while the worker is still starting, or is dead.
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(rpc_address)
                spec = WorkerProcSpec(
                    rank,
                    world_size,
                    self.output_rank,
                    vllm_config,
                    rpc_address,
                    response_address,
                    self.ipc_dir,
                )
                # Daemonic, so multiprocessing's exit handler terminates rather than joins them
                # if this process ends without shutdown() having run.
                proc = mp_ctx.Process(
                    target=run_worker,
                    args=(spec, death_reader),
                    name=f"VllmWorker-{rank}",
                    daemon=True,
                )
                # The workers share this machine's CPUs; their OpenMP settings must be in
                # their environment before they import torch.
                with thread_policy.child_env(world_size):
                    proc.start()
                self._procs.append(proc)
                self.pids.append(proc.pid)
            death_reader.close()
            self._await_ready()
        except BaseException:
            death_reader.close()
            self.close()
            raise
        self._reader = threading.Thread(target=self._read, name="vllm-mp-responses", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ calls

    def submit(
        self, method: WorkerMethod | Callable[..., Any], args: tuple, reply_all: bool
    ) -> Future:
        """Sends one Call to every worker; returns its Future.

        Raises RuntimeError when a worker has died or the group is closed, and pickling errors
        when the arguments cannot be sent.
        """
        call_id = next(self._call_ids)
        frames = worker_messages.encode(Call(call_id, method, args, reply_all))
        future: Future = Future()
        with self._lock:
            self._raise_if_unusable()
            waiting = set(range(self.world_size)) if reply_all else {self.output_rank}
            call = _Call(call_id, future, waiting, self.output_rank, gather=reply_all)
            self._calls[call_id] = call
            self._order.append(call)
            for sock in self._rpc:
                sock.send_multipart(frames, copy=True)
        return future

    def sentinels(self) -> list[int]:
        """The worker processes' sentinels (readable once the process has exited), by rank;
        empty once the group is closed (their descriptors are gone)."""
        with self._lock:
            if self._closed:
                return []
        return [proc.sentinel for proc in self._procs]

    def check(self) -> None:
        """Raises RuntimeError when a worker has died or the group is closed."""
        with self._lock:
            self._raise_if_unusable()
        for rank, proc in enumerate(self._procs):
            with self._reap_lock:
                alive = is_alive_confirmed(proc)
                message = "" if alive else self._death_message(rank)
            if not alive:
                self._fail(message)
                raise RuntimeError(self._error or message)

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            raise RuntimeError(self._error)
        if self._closed:
            raise RuntimeError("MultiprocExecutor: the executor has been shut down")

    def _worker_exited(self, rank: int) -> str:
        """The death message of worker `rank`, whose sentinel fired, once it is reaped (at
        most _REAP_TIMEOUT_S)."""
        with self._reap_lock:
            self._procs[rank].join(_REAP_TIMEOUT_S)
            return self._death_message(rank)

    def _death_message(self, rank: int) -> str:
        proc = self._procs[rank]
        return (
            f"MultiprocExecutor: worker rank {rank} (pid {proc.pid}) died unexpectedly "
            f"({_describe_exit(proc.exitcode)}); the engine cannot continue"
        )

    def _fail(self, message: str) -> None:
        """Marks the group unusable and fails every pending call with RuntimeError(message)."""
        with self._lock:
            if self._error is None and not self._closed:
                self._error = message
            pending = list(self._order)
            self._order.clear()
            self._calls.clear()
        for call in pending:
            call.error = RuntimeError(message)
            call.resolve()

    # ------------------------------------------------------------------ replies

    def _await_ready(self) -> None:
        poller = zmq.Poller()
        poller.register(self._responses, zmq.POLLIN)
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        ready: set[int] = set()
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while len(ready) < self.world_size:
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                raise RuntimeError(
                    f"MultiprocExecutor: workers {sorted(set(range(self.world_size)) - ready)} "
                    f"did not start within {_STARTUP_TIMEOUT_S:.0f} s"
                )
            events = dict(poller.poll(left_ms))
            if self._responses in events:
                ready.add(self._startup_reply())
                continue
            for fd, rank in sentinels.items():
                if fd in events:
                    # A worker that failed to start reports why just before exiting: prefer
                    # its message if it is still on the way.
                    if self._responses.poll(_REAP_TIMEOUT_S * 1000):
                        ready.add(self._startup_reply())
                    self._procs[rank].join(_REAP_TIMEOUT_S)
                    raise RuntimeError(
                        f"MultiprocExecutor: worker rank {rank} (pid {self.pids[rank]}) died "
                        f"during startup ({_describe_exit(self._procs[rank].exitcode)})"
                    )

    def _startup_reply(self) -> int:
        """Reads one startup reply; returns the Ready rank or raises the worker's error (and
        RuntimeError for anything but Ready or a startup Failure)."""
        reply = worker_messages.recv(self._responses)
        if isinstance(reply, Ready):
            return reply.rank
        if isinstance(reply, Failure) and reply.call_id is None:
            where = f"worker rank {reply.rank} (pid {self.pids[reply.rank]}) at startup"
            raise reply.error.rebuild(where)
        raise RuntimeError(f"MultiprocExecutor: a worker replied {reply!r} during startup")

    def _read(self) -> None:
        """Reader thread: completes futures in call order; fails them all when a worker dies."""
        try:
            poller = zmq.Poller()
            poller.register(self._responses, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
            for fd in sentinels:
                poller.register(fd, zmq.POLLIN)
            while True:
                events = dict(poller.poll())
                if self._wake_r in events:
                    return
                self._drain()
                dead = [rank for fd, rank in sentinels.items() if fd in events]
                if dead:
                    if not self._closed:
                        self._fail(self._worker_exited(dead[0]))
                    return
        except Exception as exc:
            if not self._closed:
                self._fail(f"MultiprocExecutor: the response reader failed: {exc!r}")

    def _drain(self) -> None:
        """Handles every reply waiting on the response socket.

        Raises MessageDecodeError for a reply that names no call, and RuntimeError for a
        message that is not a call's reply (the reader then fails the group).
        """
        while True:
            try:
                reply = worker_messages.recv(self._responses, zmq.NOBLOCK)
            except zmq.Again:
                return
            except MessageDecodeError as exc:
                if exc.call_id is None or exc.rank is None:
                    raise
                # The value did not unpickle here: the call fails with that error.
                reply = Failure(exc.call_id, exc.rank, RemoteError.capture(exc.error))
            if not isinstance(reply, (Result, Failure)):
                raise RuntimeError(f"a worker sent {reply!r} after startup")
            self._on_reply(reply)

    def _on_reply(self, reply: Result | Failure) -> None:
        rank = reply.rank
        where = f"worker rank {rank} (pid {self.pids[rank]})"
        done: list[_Call] = []
        with self._lock:
            call = self._calls.get(reply.call_id)
            if call is None:
                if isinstance(reply, Result) or self._error is not None or self._closed:
                    return
                # A non-output rank failed a call the output rank had already answered: the
                # workers no longer agree on their state.
                fatal = f"MultiprocExecutor: {where} failed after the call completed: " + (
                    f"{reply.error.type_name}: {reply.error.message}"
                )
            else:
                fatal = None
                if isinstance(reply, Failure):
                    call.error = call.error or reply.error.rebuild(where)
                else:
                    call.results[rank] = reply.value
                call.waiting.discard(rank)
                while self._order and not self._order[0].waiting:
                    head = self._order.popleft()
                    del self._calls[head.call_id]
                    done.append(head)
        if fatal is not None:
            self._fail(fatal)
        for call in done:
            call.resolve()

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stops the workers (asked, then SIGTERM, then SIGKILL), the reader thread, and the
        sockets; removes the socket directory; fails pending calls. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for sock, proc in zip(self._rpc, self._procs):
            if proc.is_alive():
                try:
                    worker_messages.send(sock, Shutdown(), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self._stop_processes()
        # Only now: a worker that sees this pipe close before a shutdown call believes the
        # engine process died.
        self._death_writer.close()
        reader = self._reader
        if reader is not None and reader.is_alive() and reader is not threading.current_thread():
            os.write(self._wake_w, b"x")
            reader.join(timeout=_EXIT_TIMEOUT_S)
        with self._lock:
            pending = list(self._order)
            self._order.clear()
            self._calls.clear()
        for call in pending:
            call.error = RuntimeError("MultiprocExecutor: the executor was shut down")
            call.resolve()
        for sock in (*self._rpc, self._responses):
            sock.close(linger=0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _stop_processes(self) -> None:
        grace = _EXIT_TIMEOUT_S if self._error is None else _EXIT_AFTER_FAILURE_TIMEOUT_S
        deadline = time.monotonic() + grace
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for stop, timeout in ((multiprocessing.Process.terminate, _TERMINATE_TIMEOUT_S),
                              (multiprocessing.Process.kill, None)):
            alive = [p for p in self._procs if p.is_alive()]
            if not alive:
                break
            for proc in alive:
                stop(proc)
            for proc in alive:
                proc.join(timeout)
        for proc in self._procs:
            proc.close()


class MultiprocExecutor(Executor):
    """Runs `parallel_config.world_size` workers in spawned processes. Every call is sent to
    all of them and answered by the output rank, the first rank of the last pipeline stage
    (collective_rpc gathers every rank's result); futures
    complete in call order. A dead worker fails pending and later calls with RuntimeError.

    Raises at construction what a worker raised while loading its model (with the remote
    traceback as cause), or RuntimeError when a worker dies during startup.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self._group = _WorkerGroup(vllm_config)
        self._finalizer = weakref.finalize(self, self._group.close)
        # Registered now, after multiprocessing's own exit handler, so it runs first (atexit
        # is last-in first-out) and multiprocessing finds the workers already gone.
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, by rank."""
        return list(self._group.pids)

    @property
    def ipc_dir(self) -> str:
        """Directory holding this executor's ipc socket files (removed by shutdown)."""
        return self._group.ipc_dir

    def dispatch(
        self, method: WorkerMethod | Callable[..., Any], args: tuple, reply_all: bool
    ) -> Future:
        """Sends one Call to every worker (see Executor.dispatch); a function must be
        picklable. Results are plain values: workers finish async model outputs before they
        answer. Raises RuntimeError when a worker died or the executor is shut down, and
        pickling errors when the arguments cannot be sent."""
        return self._group.submit(method, args, reply_all)

    def check_health(self) -> None:
        """Raises RuntimeError naming the worker when one has died."""
        self._group.check()

    def death_sentinels(self) -> list[int]:
        """The worker processes' sentinels: each turns readable when its worker exits."""
        return self._group.sentinels()

    def shutdown(self) -> None:
        """Stops the workers and removes the sockets; pending calls fail. Idempotent."""
        self._finalizer()
        atexit.unregister(self._finalizer)
