"""Oracle: the Ray executor across two Ray nodes gives what the mp executor gives.

A real two-node cluster is started on loopback addresses (127.0.0.1 and 127.0.0.2, one
machine) for the module and stopped after it. `-pp 2` with one stage per node, under async
scheduling and with every request structured (greedy, seeded, penalties, logprobs), must give
the mp executor's tokens and logprobs exactly, every output passing the grammar oracle;
`-tp 2` with one rank per node must give the mp executor's greedy tokens and logprobs (the
same layout computes the same numbers). Killing one node's raylet mid-run must end in an
error within seconds, and leave no actor or placement group of the engine alive.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.test_pipeline_parallel import assert_identical
from tests.distributed.test_tensor_parallel import DEMO_PROMPTS
from tests.v1.engine.test_async_sync_equivalence import generate_all
from vllm import LLM, SamplingParams

ray = pytest.importorskip("ray", reason="the ray extra is part of the test extra")

SECOND_NODE_IP = "127.0.0.2"
# Set in the environment of `ray start`, so every process of the test cluster carries it.
CLUSTER_MARKER = "VLLM_TEST_RAY_CLUSTER"
# Fast failure detection for the kill test: a node is declared dead after ~2 s of silence.
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


def _processes_of(temp_dir: str) -> list[int]:
    """Pids of the cluster's processes: every one inherits CLUSTER_MARKER from `ray start`
    (their command lines do not all name the temp dir: Ray retitles its agents)."""
    marker = f"{CLUSTER_MARKER}={temp_dir}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _raylet_of(temp_dir: str, ip: str) -> int:
    for pid in _processes_of(temp_dir):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "raylet/raylet" in cmdline and f"--node_ip_address={ip}" in cmdline:
            return pid
    raise AssertionError(f"no raylet for {ip}")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A head node and a second node on loopback; yields the cluster's temp dir, with
    RAY_ADDRESS pointing at the head so the engine joins this cluster."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    temp_dir = tempfile.mkdtemp(prefix="vr", dir="/tmp")  # socket paths must stay short
    # Loopback only: no token authentication (the nodes and the engine would need a shared
    # token otherwise).
    auth = {"RAY_AUTH_MODE": "disabled"}
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **auth, **{CLUSTER_MARKER: temp_dir})
    common = ["--num-cpus", "2", "--disable-usage-stats", "--temp-dir", temp_dir,
              "--object-store-memory", str(100 << 20)]

    def start(*args: str) -> str:
        done = subprocess.run([ray_cli, "start", *args, *common], env=env, text=True,
                              capture_output=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    try:
        head = start("--head", "--node-ip-address", "127.0.0.1", "--port", "0",
                     "--include-dashboard", "false", "--system-config", json.dumps(SYSTEM_CONFIG))
        address = re.search(r"ray start --address='([^']+)'", head).group(1)
        start("--address", address, "--node-ip-address", SECOND_NODE_IP)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAY_ADDRESS", address)
            mp.setenv("RAY_AUTH_MODE", auth["RAY_AUTH_MODE"])
            yield temp_dir
    finally:
        if ray.is_initialized():
            ray.shutdown()
        # A second for SIGTERM (some of Ray's processes ignore it), then SIGKILL; each
        # round ends as soon as every process is gone.
        for sig, grace_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 10.0)):
            for pid in _processes_of(temp_dir):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while _processes_of(temp_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _node_ips(llm: LLM) -> list[str]:
    return llm.llm_engine.engine_core.model_executor.node_ips


def _greedy(llm: LLM) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    return [o.outputs[0] for o in llm.generate(DEMO_PROMPTS, params, use_tqdm=False)]


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_per_rank")]
COMMON = dict(max_model_len=128, max_num_seqs=16, enable_prefix_caching=False,
              async_scheduling=True)


@pytest.mark.timeout(600)
def test_two_stages_on_two_nodes_match_mp(ray_cluster: str) -> None:
    llm = LLM("demo-tiny", pipeline_parallel_size=2, distributed_executor_backend="mp",
              **COMMON)
    try:
        want = generate_all(llm, ratios=(1.0,))
    finally:
        llm.shutdown()
    llm = LLM("demo-tiny", pipeline_parallel_size=2, distributed_executor_backend="ray",
              ray_placement="spread", **COMMON)
    try:
        assert llm.llm_engine.engine_core.batch_queue_size == 2
        assert len(set(_node_ips(llm))) == 2, _node_ips(llm)
        got = generate_all(llm, ratios=(1.0,))  # every output passes the grammar oracle
    finally:
        llm.shutdown()
    assert_identical(got, want)


@pytest.fixture(scope="module")
def tp_llm(ray_cluster: str) -> Iterator[LLM]:
    """-tp 2 on Ray with one rank per node (the kill test below ends it)."""
    llm = LLM("demo-tiny", tensor_parallel_size=2, distributed_executor_backend="ray",
              ray_placement="spread", **COMMON)
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_two_ranks_on_two_nodes_match_mp(tp_llm: LLM) -> None:
    assert len(set(_node_ips(tp_llm))) == 2, _node_ips(tp_llm)
    llm = LLM("demo-tiny", tensor_parallel_size=2, distributed_executor_backend="mp", **COMMON)
    try:
        want = _greedy(llm)
    finally:
        llm.shutdown()
    got = _greedy(tp_llm)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


@pytest.mark.timeout(300)
def test_a_dead_node_is_an_error_and_leaves_the_cluster_clean(
    ray_cluster: str, tp_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    raylet = _raylet_of(ray_cluster, SECOND_NODE_IP)
    engine = tp_llm.llm_engine
    step = engine.step
    steps: list[int] = []

    def step_then_kill():  # the node dies mid-generation, after the first step, every run
        outputs = step()
        steps.append(len(steps))
        if len(steps) == 1:
            os.kill(raylet, signal.SIGKILL)
        return outputs

    monkeypatch.setattr(engine, "step", step_then_kill)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    with pytest.raises(Exception, match=rf"RayExecutor: worker rank \d \(node {SECOND_NODE_IP}\)"):
        tp_llm.generate(DEMO_PROMPTS * 8, params, use_tqdm=False)
    assert len(steps) >= 1
    tp_llm.shutdown()
    from ray.util import placement_group_table

    groups = placement_group_table()
    assert groups and all(g["state"] == "REMOVED" for g in groups.values()), groups
    actors = ray._private.state.actors()
    assert actors and all(a["State"] == "DEAD" for a in actors.values()), actors


# ---------------------------------------------------------------------- _Gather (no cluster)


class _Died(Exception):
    pass


def _done(result=None, error: BaseException | None = None):
    from concurrent.futures import Future

    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return future


def _gather(num_ranks: int = 2, output_rank: int | None = None):
    from vllm.v1.executor.ray_executor import _Gather

    return _Gather(num_ranks, output_rank, lambda e: isinstance(e, _Died),
                   lambda e, rank: RuntimeError(f"rank {rank}: {e!r}") if isinstance(e, _Died)
                   else e)


def test_a_dead_rank_is_named_even_after_its_peer_reported_a_broken_collective() -> None:
    gather = _gather()
    gather.on_done(0, _done(error=ValueError("connection closed by peer")))
    assert not gather.future.done()  # waits a moment for news of a death
    gather.on_done(1, _done(error=_Died()))
    with pytest.raises(RuntimeError, match=r"rank 1: _Died"):
        gather.future.result(timeout=1)


def test_a_worker_error_fails_the_call_once_every_rank_answered_or_after_the_grace(
    monkeypatch,
) -> None:
    from vllm.v1.executor import ray_executor

    gather = _gather()
    gather.on_done(1, _done(result="ok"))
    gather.on_done(0, _done(error=ValueError("bad input")))
    with pytest.raises(ValueError, match="bad input"):
        gather.future.result(timeout=0)  # every rank answered: at once
    monkeypatch.setattr(ray_executor, "_PEER_DEATH_GRACE_S", 0.2)
    gather = _gather()
    gather.on_done(0, _done(error=ValueError("stuck peer")))  # rank 1 never answers
    with pytest.raises(ValueError, match="stuck peer"):
        gather.future.result(timeout=5)


def test_results_come_by_rank_or_from_the_output_rank() -> None:
    gather = _gather(3)
    gather.on_done(2, _done(result=20))
    assert gather.missing() == [0, 1]
    for rank in (0, 1):
        gather.on_done(rank, _done(result=rank * 10))
    assert gather.missing() == []
    assert gather.future.result(timeout=0) == [0, 10, 20]
    gather = _gather(2, output_rank=1)
    gather.on_done(1, _done(result="out"))
    assert not gather.future.done()
    gather.on_done(0, _done(result=None))
    assert gather.future.result(timeout=0) == "out"


# ---------------------------------------------------------------------- check_health (no cluster)


class _PingingActor:
    """Stands in for a rank's actor handle: each ping's Future is made by the test."""

    def __init__(self) -> None:
        from concurrent.futures import Future

        self.pings: list[Future] = []
        outer = self

        class _Ping:
            @staticmethod
            def remote():
                future: Future = Future()
                outer.pings.append(future)
                return type("Ref", (), {"future": lambda self: future})()

        self.ping = _Ping


def _idle_executor(num_ranks: int):
    from types import SimpleNamespace

    from vllm.v1.executor.ray_executor import RayExecutor

    executor = RayExecutor.__new__(RayExecutor)
    executor._ray = SimpleNamespace(
        nodes=lambda: [{"NodeID": "n", "Alive": True}], exceptions=ray.exceptions)
    executor._lock = threading.Lock()
    executor._error = None
    executor._pings = []
    executor.node_ips = ["10.0.0.1"] * num_ranks
    executor._node_ids = ["n"] * num_ranks
    executor._cluster = SimpleNamespace(actors=[_PingingActor() for _ in range(num_ranks)])
    return executor


def test_a_rank_that_dies_between_calls_fails_the_health_check_without_waiting() -> None:
    executor = _idle_executor(2)
    actors = executor._cluster.actors
    executor.check_health()  # sends the first pings
    assert [len(a.pings) for a in actors] == [1, 1]
    # Unanswered pings (queued behind calls) are neither news nor sent again.
    executor.check_health()
    assert [len(a.pings) for a in actors] == [1, 1]
    actors[0].pings[0].set_result(123)
    actors[1].pings[0].set_result(124)
    executor.check_health()
    assert [len(a.pings) for a in actors] == [2, 2]
    actors[1].pings[1].set_exception(ray.exceptions.RayActorError())
    with pytest.raises(RuntimeError,
                       match=r"worker rank 1 \(node 10\.0\.0\.1\) died between calls"):
        executor.check_health()
    # The executor stays unusable: the next check and every call fail the same way.
    with pytest.raises(RuntimeError, match=r"worker rank 1"):
        executor.check_health()
