"""The API server's handle on the engine-core process: start it, feed it, listen to it."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import glob
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_for

import msgspec
import zmq
import zmq.asyncio

from vllm import thread_policy
from vllm.config import VllmConfig
from vllm.exceptions import EngineConfigError, EngineDeadError, ErrorKind
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.core_proc import run_engine_core
from vllm.v1.engine.messages import EngineCoreError, EngineCoreHandshake, OutputType, RequestType
from vllm.v1.metrics.engine_stats import EngineCoreStats
from vllm.v1.spawn import main_module_hidden

logger = logging.getLogger(__name__)


class EngineCoreClient:
    """Starts an engine-core process and talks to it over ZMQ (ipc sockets in a temp dir).

    Requests and aborts are sent at once (never blocking). Outputs arrive in a background
    asyncio task started by `start(...)`, which hands them to the given callbacks; when the
    process dies (or its loop fails) the `on_dead` callback gets the reason, once.
    The constructor blocks until the engine is ready; it raises EngineConfigError, a
    ValueError (bad configuration found in the engine), or RuntimeError (any other startup
    failure) with the engine's message, leaving nothing behind.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        startup_timeout_s: float | None = None,
        engine_index: int = 0,
    ) -> None:
        """`engine_index` is this engine's place among `--data-parallel-size` engines (it
        picks the engine's GPUs on CUDA)."""
        self.vllm_config = vllm_config
        self.num_blocks = 0
        self._dead_reason: str | None = None
        self._closed = False
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_dead: Callable[[str], None] | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="vllm-ipc-")
        input_address = f"ipc://{self._ipc_dir}/input"
        output_address = f"ipc://{self._ipc_dir}/output"
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # unbounded queue: sends never block
        self._input.setsockopt(zmq.LINGER, 0)
        # Senders connect and receivers bind: a connecting PUSH queues messages even before
        # (or after) its peer is there, so a send never blocks or fails.
        self._input.connect(input_address)
        self._async_ctx = zmq.asyncio.Context()
        self._output = self._async_ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._stats_decoder = msgspec.msgpack.Decoder(EngineCoreStats)
        self._error_decoder = msgspec.msgpack.Decoder(EngineCoreError)

        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        # Not a daemon: the engine core may start worker processes of its own.
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(vllm_config, input_address, output_address, writer),
            name="EngineCore",
            daemon=False,
        )
        # Runs before multiprocessing's own exit hook, which would wait for the process forever.
        atexit.register(_shutdown_ref, weakref.ref(self))
        pc = vllm_config.parallel_config
        try:
            # The engine core (and the workers it starts) inherit the thread policy; every
            # rank of every data-parallel engine shares this machine's CPUs. The environment
            # is the process's: one engine starts at a time.
            with _START_LOCK, main_module_hidden(), thread_policy.child_env(
                pc.world_size * pc.data_parallel_size
            ), _scoped_devices(vllm_config, engine_index):
                self.proc.start()
            writer.close()
            self._wait_ready(reader, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        finally:
            reader.close()

    @property
    def pid(self) -> int | None:
        """The engine-core process id."""
        return self.proc.pid

    @property
    def pids(self) -> list[int | None]:
        """The engine-core process ids (one: see DataParallelClient)."""
        return [self.proc.pid]

    def _wait_ready(self, reader, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait_for([reader, self.proc.sentinel], left)
            if reader in ready:
                try:
                    msg = msgspec.msgpack.decode(reader.recv_bytes(), type=EngineCoreHandshake)
                except EOFError:
                    self.proc.join(5)
                    raise RuntimeError(
                        f"engine core exited during startup (exit code {self.proc.exitcode})"
                    ) from None
                if msg.ok:
                    self.num_blocks = msg.num_blocks
                    return
                if msg.error_kind is ErrorKind.CONFIG:
                    raise EngineConfigError(msg.error)
                raise RuntimeError(msg.error)
            if self.proc.sentinel in ready:
                self.proc.join(5)
                raise RuntimeError(
                    f"engine core exited during startup (exit code {self.proc.exitcode})"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise RuntimeError(f"engine core did not start within {timeout_s:g} s")

    # ------------------------------------------------------------------ background task

    def start(
        self,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_stats: Callable[[EngineCoreStats], None],
        on_dead: Callable[[str], None],
    ) -> None:
        """Starts listening in the running event loop (idempotent).

        `on_dead(reason)` runs once, soon after the process dies or reports a fatal error.
        """
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._on_dead = on_dead
        if self._dead_reason is not None or not self.proc.is_alive():
            self._mark_dead(self._dead_reason or self._exit_reason())
            return
        self._loop.add_reader(self.proc.sentinel, self._on_process_exit)
        self._task = self._loop.create_task(self._recv_loop(on_outputs, on_stats))

    async def _recv_loop(
        self,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_stats: Callable[[EngineCoreStats], None],
    ) -> None:
        try:
            while True:
                kind, payload = await self._output.recv_multipart(copy=False)
                kind = bytes(kind.buffer)
                if kind == OutputType.OUTPUTS.value:
                    on_outputs(self._outputs_decoder.decode(payload.buffer))
                elif kind == OutputType.STATS.value:
                    on_stats(self._stats_decoder.decode(payload.buffer))
                elif kind == OutputType.ERROR.value:
                    self._mark_dead(self._error_decoder.decode(payload.buffer).message)
                    return
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:
            if not self._closed:
                self._mark_dead(f"engine core connection failed: {e}")
        except Exception as e:  # a bug in a callback must not silently stop all outputs
            logger.exception("output handler failed")
            self._mark_dead(f"output handler failed: {type(e).__name__}: {e}")

    def _on_process_exit(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.proc.sentinel)
        self._mark_dead(self._exit_reason())

    def _exit_reason(self) -> str:
        self.proc.join(0.1)
        code = self.proc.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return f"engine core process died (killed by {name})"
        return f"engine core process died (exit code {code})"

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is None:
            self._dead_reason = reason
            if not self._closed:
                logger.error("%s", reason)
        if self._on_dead is not None:
            callback, self._on_dead = self._on_dead, None
            callback(self._dead_reason)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is unusable, or None while it is alive."""
        if self._dead_reason is None and not self.proc.is_alive():
            self._dead_reason = self._exit_reason()
        return self._dead_reason

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request for the engine. Raises EngineDeadError once the engine is gone."""
        self._send(RequestType.ADD, self._encoder.encode(request))

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Queues requests (the samples of one request) for the engine, in order. Raises
        EngineDeadError once the engine is gone (some may have been sent)."""
        for request in requests:
            self.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Aborts engine-side request ids (unknown or finished ids are ignored there).

        Never raises: aborting on a dead engine has nothing left to do.
        """
        if not request_ids or self._dead_reason is not None or self._closed:
            return
        try:
            self._send(RequestType.ABORT, self._encoder.encode(request_ids))
        except EngineDeadError:
            pass

    def _send(self, kind: RequestType, payload: bytes) -> None:
        if self._closed:
            raise EngineDeadError("engine core client is shut down")
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        try:
            self._input.send_multipart([kind.value, payload], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops the engine-core process and everything it started; removes the ipc files.

        Asks politely first, then SIGTERM, then SIGKILL for the whole process group. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._on_dead = None
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self.proc.sentinel)
            except (ValueError, OSError, RuntimeError):
                pass
            if self._task is not None and not self._task.done():
                self._task.cancel()
        if self.proc.pid is not None:
            if self.proc.is_alive():
                try:
                    self._input.send_multipart([RequestType.SHUTDOWN.value, b""], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout_s)
            _kill_group(self.proc.pid)
            self.proc.join(timeout_s)
            _remove_worker_dirs(self.proc.pid)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


# Engine cores start with a scoped environment (threads, devices): one at a time.
_START_LOCK = threading.Lock()


@contextlib.contextmanager
def _scoped_devices(vllm_config: VllmConfig, engine_index: int) -> Iterator[None]:
    """On CUDA with several data-parallel engines, shows engine `engine_index` only its own
    GPUs (the next world_size of those visible) while it starts."""
    pc = vllm_config.parallel_config
    if (pc.data_parallel_size == 1 or vllm_config.model_config.device.type != "cuda"
            or pc.executor_facts()[1]):
        yield
        return
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    first = engine_index * pc.world_size
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices[first:first + pc.world_size])
    try:
        yield
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def _remove_worker_dirs(pid: int) -> None:
    """Removes the socket directories the engine core `pid`'s executor made (it removes them
    itself when it exits cleanly, not when it had to be killed)."""
    from vllm.v1.executor.multiproc_executor import ipc_dir_prefix

    prefix = ipc_dir_prefix(pid)
    for base in {tempfile.gettempdir(), "/tmp"}:
        for path in glob.glob(os.path.join(glob.escape(base), glob.escape(prefix) + "*")):
            shutil.rmtree(path, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    """SIGKILLs what is left of the engine's process group (e.g. orphaned workers)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _shutdown_ref(ref: weakref.ref) -> None:
    client = ref()
    if client is not None:
        client.shutdown()
