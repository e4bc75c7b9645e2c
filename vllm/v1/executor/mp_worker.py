"""The worker process of MultiprocExecutor: receives RPCs in order, runs them on a Worker, and
sends results back from a separate output thread."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import zmq

from vllm.config import VllmConfig
from vllm.v1.executor import worker_messages
from vllm.v1.executor.worker_host import WorkerHost
from vllm.v1.executor.worker_messages import Call, Failure, MessageDecodeError, Ready, Result
from vllm.v1.executor.worker_messages import Shutdown

# Exit code of a worker whose output thread failed (responses can no longer be sent).
_OUTPUT_THREAD_FAILED = 70
# How long a closing worker keeps trying to deliver its last responses.
_LINGER_MS = 2000


@dataclass
class WorkerProcSpec:
    """Everything a worker process needs to start (pickled into the spawned process)."""

    # This worker's rank, 0..world_size-1.
    rank: int
    # Number of worker processes.
    world_size: int
    # The rank whose results answer calls that only need one reply.
    output_rank: int
    # The engine configuration the Worker is built from.
    vllm_config: VllmConfig
    # ZMQ address this worker binds to receive RPCs (the executor connects to it).
    rpc_address: str
    # ZMQ address of the executor's response socket (this worker connects to it).
    response_address: str
    # The executor's socket directory: the output rank removes it if the engine process dies
    # (nobody else is left to).
    ipc_dir: str


class _OutputThread:
    """Sends replies in the order they are queued; finishes async model outputs first.

    Owns the response socket (ZMQ sockets are not thread-safe), so every reply, including
    the main loop's, goes through it; this also keeps them in call order.
    """

    def __init__(self, sock: zmq.Socket, host: WorkerHost) -> None:
        self._sock = sock
        self._host = host
        self._queue: queue.SimpleQueue[Ready | Result | Failure | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"vllm-worker{host.rank}-output", daemon=True)
        self._thread.start()

    def put(self, reply: Ready | Result | Failure) -> None:
        """Queues one reply."""
        self._queue.put(reply)

    def stop(self) -> None:
        """Sends what is queued, then stops the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        try:
            while (reply := self._queue.get()) is not None:
                self._sock.send_multipart(self._host.encode(reply), copy=True)
        except BaseException:
            # Without this thread the executor would wait forever for replies: dying makes the
            # executor notice at once.
            traceback.print_exc()
            os._exit(_OUTPUT_THREAD_FAILED)


def _serve(host: WorkerHost, rpc: zmq.Socket, death_fd: int, out: _OutputThread) -> bool:
    """Runs calls in arrival order. Returns True when told to shut down, False when the
    engine process is gone (its end of the death pipe closed without a Shutdown).

    Raises MessageDecodeError for frames whose header does not decode (no call to answer).
    """
    poller = zmq.Poller()
    poller.register(rpc, zmq.POLLIN)
    poller.register(death_fd, zmq.POLLIN)
    while True:
        try:
            # Under async scheduling the next call is usually queued already: skip the poll.
            msg = worker_messages.recv(rpc, zmq.NOBLOCK)
        except zmq.Again:
            events = dict(poller.poll())
            if death_fd in events:
                return False
            continue
        except MessageDecodeError as exc:
            out.put(host.reject(exc))
            continue
        if isinstance(msg, Shutdown):
            return True
        if not isinstance(msg, Call):
            raise TypeError(f"worker rank {host.rank}: the engine sent a reply message: {msg!r}")
        reply = host.answer(msg)
        if reply is not None:
            out.put(reply)


def run_worker(spec: WorkerProcSpec, death_reader: Connection) -> None:
    """Entry point of a worker process: builds the Worker, replies Ready (or the startup
    Failure, then exits with code 1), and serves Calls. Returns when told to shut down or when
    `death_reader` reports that the parent process has exited."""
    # Ctrl-C reaches the whole process group; the engine process decides how to stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One machine: the local rank is the rank.
    host = WorkerHost(spec.rank, spec.world_size, spec.rank, spec.output_rank)
    ctx = zmq.Context(1)
    rpc = ctx.socket(zmq.PULL)
    rpc.bind(spec.rpc_address)
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, _LINGER_MS)
    sock.connect(spec.response_address)
    out = _OutputThread(sock, host)
    told_to_stop = False
    try:
        started = host.start(spec.vllm_config, f"file://{spec.ipc_dir}/distributed-init")
        out.put(started)
        if isinstance(started, Ready):
            told_to_stop = _serve(host, rpc, death_reader.fileno(), out)
            if not told_to_stop:
                # The engine process died: nobody reads our replies or removes its sockets.
                sock.setsockopt(zmq.LINGER, 0)
                if spec.rank == spec.output_rank:
                    shutil.rmtree(spec.ipc_dir, ignore_errors=True)
        out.stop()
        if told_to_stop:
            host.close()
    finally:
        rpc.close(linger=0)
        sock.close()
        ctx.term()
    if not isinstance(started, Ready):
        sys.exit(1)
