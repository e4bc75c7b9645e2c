"""A worker that dies while nothing runs is noticed: the idle engine core checks its executor
every `health_check_interval_s`, and the front end (one engine or several under -dp) marks the
engine dead, drops its gauges and stops routing to it. Fake executors; the end-to-end check
with real mp workers is tests/entrypoints/openai/test_health_check.py."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from tests.v1.core.sched_utils import demo_model_config, make_config
from tests.v1.engine.fake_executor import FakeExecutor
from vllm.config import ParallelConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.core_proc import EngineCoreProc
from vllm.v1.engine.data_parallel import DataParallelClient, EngineState
from vllm.v1.engine.messages import EngineCoreError, OutputType, RequestType
from vllm.v1.metrics.engine_stats import EngineCoreStats, KVCacheStats
from vllm.v1.metrics.prometheus import PrometheusMetrics

DEADLINE_S = 30.0


class DyingExecutor(FakeExecutor):
    """A FakeExecutor whose worker "dies" when `kill` is set: check_health then raises, as
    MultiprocExecutor's does for a dead rank. Counts the checks. Its death sentinel is the
    read end of a pipe that `fire_sentinel` writes to (as a worker process's sentinel turns
    readable when it exits)."""

    kill: threading.Event
    checks: int
    pipe: tuple[int, int]

    def check_health(self) -> None:
        """Raises RuntimeError once `kill` is set; counts every call."""
        type(self).checks += 1
        if type(self).kill.is_set():
            raise RuntimeError("FakeExecutor: worker rank 0 (pid 1) died unexpectedly")

    def death_sentinels(self) -> list[int]:
        """The pipe's read end."""
        return [type(self).pipe[0]]

    @classmethod
    def fire_sentinel(cls) -> None:
        """Makes the sentinel readable (for good, like a dead process's)."""
        os.write(cls.pipe[1], b"x")

    def shutdown(self) -> None:
        """Stops the fake worker thread and closes the pipe."""
        super().shutdown()
        for fd in type(self).pipe:
            try:
                os.close(fd)
            except OSError:
                pass


def _executor_class() -> type[DyingExecutor]:
    """A fresh DyingExecutor subclass, so each test has its own event, counter and pipe."""
    return type("Dying", (DyingExecutor,),
                {"kill": threading.Event(), "checks": 0, "pipe": os.pipe()})


def _config(interval_s: float) -> VllmConfig:
    config = make_config(demo_model_config())
    config.parallel_config = dataclasses.replace(
        config.parallel_config, health_check_interval_s=interval_s)
    return config


class RunningProc:
    """An EngineCoreProc serving on a thread (unless `start` is False: the test then runs its
    loop), and the PULL socket its outputs reach."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 start: bool = True) -> None:
        self.executor_class = _executor_class()
        self._dir = tempfile.TemporaryDirectory(prefix="vllm-health-")
        self._ctx = zmq.Context()
        self.output = self._ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        output_address = f"ipc://{self._dir.name}/output"
        self.output.bind(output_address)
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        input_address = f"ipc://{self._dir.name}/input"
        self._input.connect(input_address)
        try:
            self.proc = EngineCoreProc(_config(interval_s), input_address, output_address,
                                       executor_class=self.executor_class, clock=clock)
        except BaseException:
            self._close_sockets()
            raise
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        if start:
            self.thread.start()

    def _run(self) -> None:
        try:
            self.proc.run_busy_loop()
        except BaseException as e:  # what the loop raised is the test's to look at
            self.error = e

    def next_error(self, deadline_s: float) -> EngineCoreError | None:
        """The first ERROR message sent before the deadline (stats are skipped), or None."""
        deadline = time.monotonic() + deadline_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.output.poll(int(left * 1000) + 1):
                continue
            kind, payload = self.output.recv_multipart()
            if kind == OutputType.ERROR.value:
                return msgspec.msgpack.decode(payload, type=EngineCoreError)
        return None

    def close(self) -> None:
        """Stops the loop (a SHUTDOWN message) and frees the engine and the sockets."""
        if self.thread.is_alive():
            self._input.send_multipart([RequestType.SHUTDOWN.value, b""])
            self.thread.join(DEADLINE_S)
        self.proc.shutdown()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.output.close(linger=0)
        self._input.close(linger=0)
        self._ctx.term()
        self._dir.cleanup()


@pytest.fixture
def running() -> Iterator[list[RunningProc]]:
    """RunningProcs the test starts; each is stopped and freed after it."""
    procs: list[RunningProc] = []
    yield procs
    for proc in procs:
        proc.close()


def test_an_idle_engine_reports_a_dead_worker_without_traffic(
    running: list[RunningProc],
) -> None:
    proc = RunningProc(interval_s=0.05)
    running.append(proc)
    proc.executor_class.kill.set()
    error = proc.next_error(DEADLINE_S)
    assert error is not None, "the idle engine never reported the dead worker"
    assert "worker rank 0" in error.message and "died" in error.message
    assert "\n" not in error.message
    proc.thread.join(DEADLINE_S)
    assert not proc.thread.is_alive()
    assert isinstance(proc.error, RuntimeError)


class _Enough(BaseException):
    """Ends a loop the test runs itself (not an Exception: the loop reports none of it)."""


class SimulatedWaits:
    """Replaces an EngineCoreProc's poller and clock so that its idle waits take no real
    time: each poll answers at once and, when nothing was ready, moves the clock on by the
    timeout the loop asked for. Raises _Enough from the poll once `checks()` reaches
    `max_checks` or after `max_polls` polls, so the loop runs on the test's thread and
    the counts depend on no machine's speed."""

    def __init__(self, max_checks: int, max_polls: int = 100) -> None:
        self.now = 0.0
        self.polls = 0
        self.max_checks = max_checks
        self.max_polls = max_polls

    def attach(self, proc: RunningProc) -> None:
        """Puts itself in place of the engine's poller (the clock went in with the engine)."""
        self._checks = lambda: proc.executor_class.checks
        self._poller = proc.proc._poller
        proc.proc._poller = self

    def __call__(self) -> float:
        return self.now

    def poll(self, timeout_ms: int | None = None) -> list:
        """The poller's answer without waiting; see the class."""
        if self._checks() >= self.max_checks or self.polls >= self.max_polls:
            raise _Enough
        self.polls += 1
        events = self._poller.poll(0)
        if not events and timeout_ms:
            self.now += timeout_ms / 1000
        return events

    def __getattr__(self, name: str):
        return getattr(self._poller, name)  # register / unregister


def _simulated(interval_s: float, running: list[RunningProc], max_checks: int,
               ) -> tuple[RunningProc, SimulatedWaits]:
    waits = SimulatedWaits(max_checks)
    proc = RunningProc(interval_s=interval_s, clock=waits, start=False)
    running.append(proc)
    waits.attach(proc)
    return proc, waits


def test_the_idle_check_is_periodic_not_a_busy_loop(running: list[RunningProc]) -> None:
    interval_s = 0.2
    proc, waits = _simulated(interval_s, running, max_checks=3)
    with pytest.raises(_Enough):
        proc.proc.run_busy_loop()
    checks = proc.executor_class.checks
    assert checks == 3, "the idle engine does not check its workers periodically"
    # Every wake-up of the idle loop is a due check (a busy loop polls without end), and
    # none comes before its interval has passed.
    assert waits.polls <= checks + 1, (waits.polls, checks)
    assert waits.now >= checks * interval_s


def test_a_worker_sentinel_wakes_the_idle_engine_at_once(running: list[RunningProc]) -> None:
    # An hour between periodic checks: only the sentinel can bring the news in time.
    proc = RunningProc(interval_s=3600.0)
    running.append(proc)
    proc.executor_class.kill.set()
    proc.executor_class.fire_sentinel()
    error = proc.next_error(DEADLINE_S)
    assert error is not None, "the worker's sentinel did not wake the idle engine"
    assert "worker rank 0" in error.message


def test_a_sentinel_without_a_death_does_not_spin_the_loop(running: list[RunningProc]) -> None:
    interval_s = 0.2
    proc, waits = _simulated(interval_s, running, max_checks=4)
    proc.executor_class.fire_sentinel()  # readable for good, yet every worker is alive
    with pytest.raises(_Enough):
        proc.proc.run_busy_loop()
    checks = proc.executor_class.checks
    assert checks == 4
    # One check for the sentinel, then one per interval: a loop woken by the readable
    # sentinel again and again would check four times with no time passing.
    assert checks <= waits.now / interval_s + 1, (checks, waits.now)
    assert waits.polls <= checks + 1, (waits.polls, checks)
    # The periodic check still finds a real death afterwards.
    proc.executor_class.kill.set()
    waits.max_checks += 1
    with pytest.raises(RuntimeError, match="died"):
        proc.proc.run_busy_loop()
    error = proc.next_error(DEADLINE_S)
    assert error is not None and "worker rank 0" in error.message


def test_the_interval_is_validated() -> None:
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match=r"--health-check-interval: must be a positive"):
            ParallelConfig(health_check_interval_s=bad)


# ---------------------------------------------------------------------- data parallel


def _stats(running: int, waiting: int, usage: float, blocks: int) -> EngineCoreStats:
    return EngineCoreStats(
        num_running=running, num_waiting=waiting, num_preemptions=1, num_aborted_requests=0,
        timestamp=0.0, kv=KVCacheStats(usage=usage, num_free_blocks=int(blocks * (1 - usage)),
                                       num_blocks=blocks))


class _FakeClient:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.dead_reason: str | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request.request_id)


def _dp_client(num_engines: int) -> tuple[DataParallelClient, dict[str, list]]:
    client = DataParallelClient.__new__(DataParallelClient)
    client.engines = [EngineState(i) for i in range(num_engines)]
    client.clients = [_FakeClient() for _ in range(num_engines)]
    client.retried = set()
    seen: dict[str, list] = {"outputs": [], "stats": [], "dead": []}
    client._on_outputs = seen["outputs"].append
    client._on_stats = seen["stats"].append
    client._on_dead = seen["dead"].append
    return client, seen


def _request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2], SamplingParams(), 0.0)


def test_a_dead_engine_leaves_the_gauges_and_is_never_routed_to() -> None:
    client, seen = _dp_client(2)
    client._stats(0, _stats(running=0, waiting=0, usage=0.0, blocks=100))
    client._stats(1, _stats(running=3, waiting=2, usage=0.5, blocks=100))
    client.add_requests([_request("busy")])
    # Its client has seen a token, so it cannot move to another engine.
    client._outputs(0, EngineCoreOutputs([EngineCoreOutput("busy", [5])]))
    # Engine 0 is idle and would get the next request, but it is found dead first.
    client._engine_died(0, "engine core died: RuntimeError: worker rank 0 died")
    client.add_requests([_request("after")])
    assert client.clients[0].added == ["busy"] and client.clients[1].added == ["after"]
    # The request it held (and answered) fails at once with finish_reason "error".
    lost: EngineCoreOutputs = seen["outputs"][-1]
    assert [(o.request_id, o.finish_reason) for o in lost.outputs] == [("busy", "error")]
    total: EngineCoreStats = seen["stats"][-1]
    assert (total.num_running, total.num_waiting, total.kv.num_blocks) == (3, 2, 100)
    assert total.kv.usage == pytest.approx(0.5)
    # A snapshot from the dead engine still on its way changes nothing.
    client._stats(0, _stats(running=9, waiting=9, usage=1.0, blocks=100))
    assert seen["stats"][-1] is total
    assert seen["dead"] == [] and client.dead_reason is None
    client._engine_died(1, "engine core process died (killed by SIGKILL)")
    assert len(seen["dead"]) == 1 and seen["stats"][-1].num_running == 0


def test_metrics_count_dead_engines_and_zero_their_gauges() -> None:
    def scrape(metrics: PrometheusMetrics) -> dict[str, float]:
        out = {}
        for line in metrics.render().decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                # One engine's engine="0" label dropped, then a lone model_name label.
                key = key.replace('engine="0",', "").replace('{model_name="m"}', "")
                out[key] = float(value)
        return out

    single = PrometheusMetrics("m")
    single.record_engine_stats(_stats(running=2, waiting=1, usage=0.25, blocks=64))
    before = scrape(single)
    assert before["vllm:engine_dead_total"] == 0 and before["vllm:num_requests_running"] == 2
    single.record_engine_dead()
    after = scrape(single)
    assert after["vllm:engine_dead_total"] == 1 and after["vllm:engine_alive"] == 0
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:num_preemptions_total"] == 1  # counters keep their values

    client, _ = _dp_client(3)
    dp = PrometheusMetrics("m")
    dp.watch_engines(client.engine_states)
    assert scrape(dp)["vllm:engine_dead_total"] == 0
    client._engine_died(2, "gone")
    m = scrape(dp)
    assert m["vllm:engine_dead_total"] == 1 and m["vllm:engine_alive"] == 1
    alive = {k: v for k, v in m.items() if k.startswith("vllm:data_parallel_engine_alive")}
    assert [v for k, v in sorted(alive.items())] == [1, 1, 0], alive
