"""The engine core in its own process: a busy loop between two ZMQ sockets."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec
import zmq

from vllm import thread_policy
from vllm.config import VllmConfig
from vllm.exceptions import ErrorKind, clean_message, error_kind_of
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.messages import (
    EngineCoreError,
    EngineCoreHandshake,
    OutputType,
    RequestType,
)
from vllm.v1.executor.abstract import Executor
from vllm.v1.metrics.engine_stats import EngineCoreStats

logger = logging.getLogger(__name__)

# While busy, gauges go out at most this often; an idle engine always sends a last snapshot.
STATS_INTERVAL_S = 0.1
# With work that cannot run yet (grammars compiling), wait this long for input between polls.
NO_PROGRESS_WAIT_MS = 1


class EngineCoreProc:
    """Runs an EngineCore fed by an input socket; publishes outputs and stats on another.

    Blocks on the input socket (and the parent's sentinel) while it has no work, waking
    every `parallel_config.health_check_interval_s`, or at once when a worker's death
    sentinel fires (mp), to ask the executor whether its workers live: an idle engine uses
    next to no CPU and still reports a dead worker (its loop raises, which reports the engine
    dead). Exits its loop on a SHUTDOWN message, SIGTERM, or when the parent process dies.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        input_address: str,
        output_address: str,
        parent_sentinel: int | None = None,
        executor_class: type[Executor] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Builds the engine (`executor_class`: the one the config names when None) and
        connects its sockets. `clock` times the health checks and stats (tests pass a fake)."""
        # The engine compiles grammars itself, so it needs the tokenizer's vocabulary.
        tokenizer = get_tokenizer(vllm_config.model_config.tokenizer)
        self.engine_core = EngineCore(vllm_config, executor_class, tokenizer=tokenizer)
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PULL)
        self._input.setsockopt(zmq.RCVHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        # Receivers bind, senders connect (see EngineCoreClient).
        self._input.bind(input_address)
        self._output = self._ctx.socket(zmq.PUSH)
        self._output.setsockopt(zmq.SNDHWM, 0)
        # Pending outputs get a moment to leave when the loop ends.
        self._output.setsockopt(zmq.LINGER, 2000)
        self._output.connect(output_address)
        self._poller = zmq.Poller()
        self._poller.register(self._input, zmq.POLLIN)
        self._parent_sentinel = parent_sentinel
        if parent_sentinel is not None:
            self._poller.register(parent_sentinel, zmq.POLLIN)
        self._add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._abort_decoder = msgspec.msgpack.Decoder(list[str])
        self._encoder = msgspec.msgpack.Encoder()
        self._clock = clock
        self._running = True
        # Set when the loop ended because the parent process died.
        self.parent_died = False
        self._last_stats: EngineCoreStats | None = None
        self._last_stats_time = 0.0
        # A worker that dies while nothing runs fails no call, so nothing would report it
        # until the next request: the idle loop wakes this often to ask the executor.
        self._health_interval_s = vllm_config.parallel_config.health_check_interval_s
        self._next_health_check = self._clock() + self._health_interval_s
        # Where the executor offers them (mp: the worker processes' sentinels), a worker's
        # exit wakes the loop at once, and the check runs then rather than at its interval.
        self._death_sentinels = set(self.engine_core.worker_death_sentinels())
        for fd in self._death_sentinels:
            self._poller.register(fd, zmq.POLLIN)
        # The sentinels that fired since the last health check.
        self._fired: set[int] = set()

    # ------------------------------------------------------------------ loop

    def run_busy_loop(self) -> None:
        """Serves until shutdown. Raises whatever an engine step raises (after reporting it)."""
        core = self.engine_core
        try:
            while self._running:
                if not core.has_work():
                    self._send_stats(force=True)
                    self._handle_input(timeout_ms=self._ms_to_health_check())
                    self._check_health_if_due()
                    continue
                self._handle_input(timeout_ms=0)
                if not self._running or not core.has_work():
                    continue
                outputs, executed = core.step_fn()
                if outputs:
                    self._send_outputs(outputs)
                elif not executed:
                    # Waiting on grammars: no step touches the workers, so check them here.
                    self._handle_input(timeout_ms=NO_PROGRESS_WAIT_MS)
                    self._check_health_if_due()
                self._send_stats(force=False)
        except Exception as e:
            self._report_error(e)
            raise

    def _ms_to_health_check(self) -> int:
        """Milliseconds until the next worker health check is due (0 when overdue)."""
        return max(0, int((self._next_health_check - self._clock()) * 1000) + 1)

    def _check_health_if_due(self) -> None:
        """Runs the executor's health check once its interval has passed; raises what it
        raises (a dead worker), which ends the loop and reports the engine dead."""
        now = self._clock()
        if not self._running or (now < self._next_health_check and not self._fired):
            return
        self._next_health_check = now + self._health_interval_s
        # The executor confirms a fired sentinel's death (a bounded wait for the reap), so
        # a worker that just exited is reported here, not one interval later.
        self.engine_core.check_health()
        if self._fired:
            # A sentinel fired yet its worker is alive: stop watching that one alone (it
            # stays readable and would wake the loop without end); the others still tell
            # a death at once, and the periodic check covers this one.
            logger.warning("engine core: %d worker sentinel(s) fired but the executor reports "
                           "those workers alive; checking them every %g s instead",
                           len(self._fired), self._health_interval_s)
            for fd in self._fired:
                self._poller.unregister(fd)
            self._death_sentinels -= self._fired
            self._fired.clear()

    def _handle_input(self, timeout_ms: int | None) -> None:
        """Waits up to timeout_ms (None: forever) for input, then drains every queued message."""
        events = dict(self._poller.poll(timeout_ms))
        self._fired |= self._death_sentinels.intersection(events)
        if self._parent_sentinel is not None and self._parent_sentinel in events:
            logger.warning("engine core: the API server process died; shutting down")
            self.parent_died = True
            self._running = False
            return
        if self._input not in events:
            return
        while True:
            try:
                kind, payload = self._input.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._dispatch(bytes(kind.buffer), payload.buffer)
            if not self._running:
                return

    def _dispatch(self, kind: bytes, payload: memoryview) -> None:
        if kind == RequestType.ADD.value:
            try:
                request = self._add_decoder.decode(payload)
            except msgspec.DecodeError as e:  # ValidationError included
                self._reject_undecodable(payload, e)
                return
            self.engine_core.add_request(request)
        elif kind == RequestType.ABORT.value:
            try:
                ids = self._abort_decoder.decode(payload)
            except msgspec.DecodeError as e:
                logger.error("engine core: ignored an abort message that does not decode: %s", e)
                return
            self.engine_core.abort_requests(ids)
        elif kind == RequestType.SHUTDOWN.value:
            self._running = False
        else:
            logger.error("engine core: unknown message type %r ignored", kind)

    def _reject_undecodable(self, payload: memoryview, error: msgspec.DecodeError) -> None:
        """Fails an add message that is not a valid EngineCoreRequest. Its sender still
        learns why when the request id can be read: the first field of the message."""
        # Decoding runs SamplingParams' checks; a value they refuse is the client's fault
        # (as it is in the API server) and keeps its own message. Any other decode failure
        # comes from a broken sender.
        kind = error_kind_of(error.__cause__)
        if kind is ErrorKind.INTERNAL:
            message = f"malformed request: {error}"
        else:
            message = str(error.__cause__)
        try:
            fields = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError:
            fields = None
        if isinstance(fields, list) and fields and isinstance(fields[0], str):
            self.engine_core.reject_request(fields[0], message, kind)
        else:
            logger.error("engine core: dropped an add message without a request id: %s", error)

    # ------------------------------------------------------------------ output

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        msg = EngineCoreOutputs(outputs=outputs, timestamp=time.time())
        self._output.send_multipart([OutputType.OUTPUTS.value, self._encoder.encode(msg)])

    def _send_stats(self, force: bool) -> None:
        now = self._clock()
        if not force and now - self._last_stats_time < STATS_INTERVAL_S:
            return
        stats = self.engine_core.make_stats()
        self._last_stats_time = now
        if stats.same_as(self._last_stats):
            return
        self._last_stats = stats
        self._output.send_multipart([OutputType.STATS.value, self._encoder.encode(stats)])

    def _report_error(self, e: BaseException) -> None:
        # The client shows the reason to HTTP clients and in /health: one clean line there,
        # the whole traceback (the remote worker's too) in this log.
        message = clean_message(f"engine core died: {type(e).__name__}: {e}")
        logger.error("%s\n%s", message, traceback.format_exc())
        try:
            payload = self._encoder.encode(EngineCoreError(message=message))
            self._output.send_multipart([OutputType.ERROR.value, payload], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def shutdown(self) -> None:
        """Stops the engine (workers, grammar threads) and closes the sockets. Idempotent."""
        self._running = False
        try:
            self.engine_core.shutdown()
        finally:
            self._input.close(linger=0)
            self._output.close()
            self._ctx.term()


def run_engine_core(
    vllm_config: VllmConfig,
    input_address: str,
    output_address: str,
    handshake: Connection,
) -> None:
    """Entry point of the engine-core process (started with multiprocessing spawn).

    Sends an EngineCoreHandshake over `handshake` once the engine is built (or failed to
    build), then serves until told to stop. Exits with status 1 when startup or a step fails.
    """
    # Its own process group: a terminal's Ctrl-C reaches only the API server, which shuts
    # this process down in order, and the client can kill the whole tree (workers too).
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s [engine core] %(message)s"
    )
    # Torch is loaded already (unpickling the config imports it), so the OpenMP policy came
    # from the environment the parent started us with; this checks it and sets torch's threads.
    thread_policy.configure_process(vllm_config.parallel_config.world_size)
    parent = multiprocessing.parent_process()
    proc: EngineCoreProc | None = None
    encoder = msgspec.msgpack.Encoder()
    try:
        proc = EngineCoreProc(
            vllm_config,
            input_address,
            output_address,
            parent.sentinel if parent is not None else None,
        )
    except BaseException as e:  # report every startup failure instead of leaving a hang
        logger.error("engine core failed to start:\n%s", traceback.format_exc())
        # Configuration checks raise ValueError while the engine is built; any other
        # failure (out of memory, a missing library, a bug) is internal.
        kind = ErrorKind.CONFIG if isinstance(e, ValueError) else ErrorKind.INTERNAL
        _send_handshake(handshake, encoder, EngineCoreHandshake(
            ok=False, error_kind=kind, error=str(e) or repr(e)
        ))
        raise SystemExit(1) from None
    _send_handshake(handshake, encoder, EngineCoreHandshake(
        ok=True, num_blocks=proc.engine_core.num_blocks
    ))
    status = 0
    try:
        proc.run_busy_loop()
    except SystemExit:
        pass
    except Exception:
        status = 1
    finally:
        proc.shutdown()
        if proc.parent_died:
            # Nobody else is left to remove the socket files.
            _remove_ipc_files([input_address, output_address])
    raise SystemExit(status)


def _remove_ipc_files(addresses: list[str]) -> None:
    """Deletes ipc:// socket files and their directory (if then empty); ignores errors."""
    dirs = set()
    for address in addresses:
        if not address.startswith("ipc://"):
            continue
        path = address[len("ipc://"):]
        dirs.add(os.path.dirname(path))
        try:
            os.unlink(path)
        except OSError:
            pass
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            pass


def _send_handshake(conn: Connection, encoder: msgspec.msgpack.Encoder,
                    msg: EngineCoreHandshake) -> None:
    try:
        conn.send_bytes(encoder.encode(msg))
    except OSError:
        pass  # the parent is gone; nothing to tell
    finally:
        conn.close()


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)
