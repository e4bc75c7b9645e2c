"""MultiprocExecutor: same tokens as the in-process executor, ordered futures, remote errors,
fast failure when a worker dies, and a clean shutdown."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import msgspec
import pytest

from vllm import LLM, SamplingParams, thread_policy
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor import worker_messages
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.worker_messages import UnknownWorkerMethodError, WorkerMethod
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

PROMPTS = ["Hello world", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _params() -> list[SamplingParams]:
    """Greedy for the first half of PROMPTS, seeded sampling for the second half."""
    half = len(PROMPTS) // 2
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(half)
    ]
    return [GREEDY] * half + seeded


# Functions sent to the workers (collective_rpc calls them as fn(worker, *args)).


def _echo(worker: object, value: object) -> object:
    return value


def _pid(worker: object) -> int:
    return os.getpid()


def _sleep_on_rank(worker: object, rank: int, seconds: float) -> int:
    if int(os.environ["RANK"]) == rank:
        time.sleep(seconds)
    return int(os.environ["RANK"])


def _getenv(worker: object, name: str) -> str | None:
    return os.environ.get(name)


def _openmp_settings(worker: object) -> tuple[str | None, str | None, int]:
    import torch

    return (
        os.environ.get("OMP_WAIT_POLICY"),
        os.environ.get("OMP_NUM_THREADS"),
        torch.get_num_threads(),
    )


def _raise_value_error(worker: object, message: str) -> None:
    raise ValueError(message)


# Helpers that look for what a shutdown must not leave behind.


def _child_pids() -> set[int]:
    """Live child processes of this process, except the stdlib's resource tracker (started
    once per interpreter by any spawn-context Process, and owned by multiprocessing)."""
    me = str(os.getpid())
    children: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        ppid = stat.rsplit(")", 1)[1].split()[1]
        if ppid == me and b"resource_tracker" not in cmdline:
            children.add(int(entry))
    return children


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _assert_nothing_left(
    executor: MultiprocExecutor, children_before: set[int], shm_before: set[str]
) -> None:
    """After shutdown: exactly this executor's workers are gone (other executors of this
    module may still run), and its socket directory and no new /dev/shm entry remain."""
    workers = set(executor.worker_pids)
    assert workers <= children_before
    assert _child_pids() == children_before - workers
    assert {p.pid for p in multiprocessing.active_children()} == children_before - workers
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}")
    assert not os.path.exists(executor.ipc_dir)
    assert _shm_entries() - shm_before == set()


@pytest.fixture(scope="module")
def shm_before() -> set[str]:
    return _shm_entries()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm_pair(request: pytest.FixtureRequest, shm_before: set[str]):
    """(mp LLM, uni LLM) with the same options; one mp engine alive at a time."""
    kwargs = dict(async_scheduling=request.param, max_num_seqs=8, max_model_len=256)
    uni = LLM("demo-tiny", distributed_executor_backend="uni", **kwargs)
    mp = LLM("demo-tiny", distributed_executor_backend="mp", **kwargs)
    yield mp, uni
    mp.shutdown()
    uni.shutdown()


def _executor(llm: LLM) -> MultiprocExecutor:
    core: EngineCore = llm.llm_engine.engine_core
    assert isinstance(core.model_executor, MultiprocExecutor)
    return core.model_executor


def _spy_sample_results(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[type]:
    """Records the type of every sample_tokens result the engine receives from `llm`."""
    executor = llm.llm_engine.engine_core.model_executor
    original = executor.sample_tokens
    seen: list[type] = []

    def sample_tokens(grammar_output, non_block=False):
        result = original(grammar_output, non_block)
        if non_block:
            result.add_done_callback(lambda f: seen.append(type(f.result())))
        else:
            seen.append(type(result))
        return result

    monkeypatch.setattr(executor, "sample_tokens", sample_tokens)
    return seen


@pytest.mark.timeout(120)
def test_same_tokens_as_uni(llm_pair: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    mp, uni = llm_pair
    mp_types = _spy_sample_results(mp, monkeypatch)
    uni_types = _spy_sample_results(uni, monkeypatch)
    got = mp.generate(PROMPTS, _params(), use_tqdm=False)
    want = uni.generate(PROMPTS, _params(), use_tqdm=False)
    # The worker finishes async outputs itself: the engine only ever sees plain ones, while
    # the in-process executor shows that the runner did return async ones.
    assert mp_types and set(mp_types) == {ModelRunnerOutput}
    async_scheduling = mp.llm_engine.vllm_config.scheduler_config.async_scheduling
    assert any(issubclass(t, AsyncModelRunnerOutput) for t in uni_types) == async_scheduling
    assert [len(o.outputs[0].token_ids) for o in got] == [MAX_TOKENS] * len(PROMPTS)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # The seeded half really samples: it differs from the greedy continuation.
    half = len(PROMPTS) // 2
    greedy = uni.generate(PROMPTS[half:], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] != [o.outputs[0].token_ids for o in got[half:]]


@pytest.mark.timeout(60)
def test_non_block_futures_resolve_in_order(llm_pair: tuple[LLM, LLM]) -> None:
    executor = _executor(llm_pair[0])
    resolved: list[int] = []
    futures = []
    for i in range(40):
        if i % 4 == 3:
            future = executor.collective_rpc(WorkerMethod.DETERMINE_NUM_BLOCKS, non_block=True)
        else:
            future = executor.collective_rpc(_echo, (i,), non_block=True)
        future.add_done_callback(lambda _, i=i: resolved.append(i))
        futures.append(future)
    results = [f.result(timeout=30) for f in futures]
    assert resolved == list(range(40))
    # A method name is parsed into its WorkerMethod at the call.
    blocks = executor.collective_rpc("determine_num_blocks")
    assert results == [blocks if i % 4 == 3 else [i] for i in range(40)]


@pytest.mark.timeout(60)
def test_worker_exception_propagates(llm_pair: tuple[LLM, LLM]) -> None:
    mp, uni = llm_pair
    executor = _executor(mp)
    with pytest.raises(ValueError, match="bad things in the worker") as info:
        executor.collective_rpc(_raise_value_error, ("bad things in the worker",))
    remote = str(info.value.__cause__)
    assert "Traceback" in remote and "_raise_value_error" in remote
    assert f"worker rank 0 (pid {executor.worker_pids[0]})" in "".join(info.value.__notes__)
    with pytest.raises(UnknownWorkerMethodError, match="'no_such_method'; workers serve: "):
        executor.collective_rpc("no_such_method")
    # The worker survives a failed call and still computes the same tokens.
    executor.check_health()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = mp.generate(PROMPTS[:2], params, use_tqdm=False)
    want = uni.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.timeout(60)
def test_worker_refuses_an_unknown_method_number(
    llm_pair: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A method number the worker does not know (as from an engine of another version) fails
    # that call with the typed error, raised here, and the worker serves the next call.
    executor = _executor(llm_pair[0])
    encode = worker_messages.encode

    def encode_unknown_method(msg: worker_messages.Message) -> list:
        frames = encode(msg)
        kind, call_id, _, reply_all = msgspec.msgpack.decode(frames[0])
        return [msgspec.msgpack.encode([kind, call_id, 99, reply_all]), *frames[1:]]

    monkeypatch.setattr(worker_messages, "encode", encode_unknown_method)
    with pytest.raises(UnknownWorkerMethodError, match="unknown worker method 99") as info:
        executor.collective_rpc(WorkerMethod.DETERMINE_NUM_BLOCKS)
    assert f"worker rank 0 (pid {executor.worker_pids[0]})" in "".join(info.value.__notes__)
    monkeypatch.undo()
    assert executor.collective_rpc(_echo, ("still serving",)) == ["still serving"]


@pytest.mark.timeout(60)
def test_shutdown_leaves_nothing(llm_pair: tuple[LLM, LLM], shm_before: set[str]) -> None:
    mp, _ = llm_pair
    executor = _executor(mp)
    pids = executor.worker_pids
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert any(name.startswith("rpc-") for name in os.listdir(executor.ipc_dir))
    children = _child_pids()
    mp.shutdown()
    _assert_nothing_left(executor, children, shm_before)
    mp.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        executor.collective_rpc(_echo, (1,))


@pytest.fixture(scope="module")
def two_workers(shm_before: set[str]):
    """A world-size-2 (tensor-parallel) executor built straight from an engine config."""
    config = EngineArgs(model="demo-tiny", tensor_parallel_size=2).create_engine_config()
    executor = MultiprocExecutor(config)
    yield executor
    executor.shutdown()


@pytest.mark.timeout(60)
def test_collective_rpc_gathers_every_rank(two_workers: MultiprocExecutor) -> None:
    pids = two_workers.collective_rpc(_pid)
    assert pids == two_workers.worker_pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert two_workers.collective_rpc(_pid, output_rank_only=True) == pids[0]
    assert two_workers.collective_rpc(_getenv, ("RANK",)) == ["0", "1"]


@pytest.mark.timeout(60)
def test_workers_split_the_cpus(two_workers: MultiprocExecutor) -> None:
    # Each of the two workers gets half the CPUs this process may use (as the fixture found the
    # environment: a user's OMP_* values would win).
    want = thread_policy.derive(2)
    assert two_workers.collective_rpc(_openmp_settings) == [
        (want.wait_policy, str(want.num_threads), want.num_threads)
    ] * 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "user", [{}, {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"}], ids=["derived", "user"]
)
def test_worker_openmp_policy(monkeypatch: pytest.MonkeyPatch, user: dict[str, str]) -> None:
    # Sleeping OpenMP threads leave the cores to the engine between forwards. The policy goes
    # to the workers only (this process's environment is unchanged), and a user's values win.
    for key in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in user.items():
        monkeypatch.setenv(key, value)
    before = dict(os.environ)
    config = EngineArgs(model="demo-tiny", distributed_executor_backend="mp").create_engine_config()
    executor = MultiprocExecutor(config)
    try:
        got = executor.collective_rpc(_openmp_settings)
    finally:
        executor.shutdown()
    threads = user.get("OMP_NUM_THREADS", str(thread_policy.available_cpus()))
    assert got == [(user.get("OMP_WAIT_POLICY", "PASSIVE"), threads, int(threads))]
    assert dict(os.environ) == before


@pytest.mark.timeout(60)
def test_later_calls_wait_for_a_slow_rank(two_workers: MultiprocExecutor) -> None:
    resolved: list[str] = []
    slow = two_workers.collective_rpc(_sleep_on_rank, (1, 0.5), non_block=True)
    # Rank 0 answers this at once, but it must not complete before the call in front of it.
    fast = two_workers.collective_rpc(_echo, ("fast",), non_block=True, output_rank_only=True)
    slow.add_done_callback(lambda _: resolved.append("slow"))
    fast.add_done_callback(lambda _: resolved.append("fast"))
    time.sleep(0.2)
    assert not fast.done()
    assert slow.result(timeout=30) == [0, 1]
    assert fast.result(timeout=30) == "fast"
    assert resolved == ["slow", "fast"]


@pytest.mark.timeout(60)
def test_killed_worker_fails_fast(two_workers: MultiprocExecutor, shm_before: set[str]) -> None:
    children = _child_pids()
    # Rank 1 sleeps far past this test's timeout: waiting for it anywhere fails the test.
    pending = two_workers.collective_rpc(_sleep_on_rank, (1, 600.0), non_block=True)
    os.kill(two_workers.worker_pids[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"worker rank 0 \(pid \d+\) died.*SIGKILL"):
        pending.result(timeout=10)
    with pytest.raises(RuntimeError, match="worker rank 0"):
        two_workers.collective_rpc(_echo, (1,))
    with pytest.raises(RuntimeError, match="SIGKILL"):
        two_workers.check_health()
    # Shutdown stops the surviving rank (still busy) without waiting for it.
    two_workers.shutdown()
    _assert_nothing_left(two_workers, children, shm_before)


_ORPHAN_SCRIPT = """
import json, os, signal
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

if __name__ == "__main__":
    config = EngineArgs(model="demo-tiny", distributed_executor_backend="mp").create_engine_config()
    executor = MultiprocExecutor(config)
    print(json.dumps({"pids": executor.worker_pids, "ipc_dir": executor.ipc_dir}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _gone(pid: int) -> bool:
    """True when the process no longer runs (absent, or a zombie its new parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.timeout(90)
def test_workers_exit_when_the_engine_process_dies(tmp_path: Path) -> None:
    import json

    import vllm

    root = Path(vllm.__file__).resolve().parent.parent
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=80
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 60  # a hang check: they exit within a poll of their parent
    while not all(_gone(pid) for pid in info["pids"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in info["pids"])
    while os.path.exists(info["ipc_dir"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(info["ipc_dir"])


class _ExitingProc:
    """A worker process in the moment after its exit: its sentinel is readable, but it is
    reaped (and `is_alive()` turns False) only once someone joins it."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self.sentinel = self._read
        self.joined = False

    def exit(self) -> None:
        os.write(self._write, b"x")

    def join(self, timeout: float | None = None) -> None:
        self.joined = True

    def is_alive(self) -> bool:
        return not self.joined

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


def test_a_fired_sentinel_is_confirmed_by_reaping_the_worker() -> None:
    from vllm.v1.executor.multiproc_executor import is_alive_confirmed

    proc = _ExitingProc()
    try:
        assert is_alive_confirmed(proc) and not proc.joined  # no sentinel: no wait
        proc.exit()
        assert not is_alive_confirmed(proc)
    finally:
        proc.close()


def _sleep_a_minute() -> None:
    time.sleep(60)


def test_a_worker_reaped_by_two_threads_at_once_is_reported_killed_by_both() -> None:
    """The reader thread (its socket closed) and the engine core's health check (the sentinel
    fired) see a killed worker at the same moment. Reaping one process from two threads
    races: the loser's waitpid fails while the winner has not stored the exit code yet, so
    it saw "still running" (or the worker alive). Both must name the signal."""
    import multiprocessing.connection

    from vllm.v1.executor.multiproc_executor import _WorkerGroup

    ctx = multiprocessing.get_context("fork")
    for _ in range(20):
        proc = ctx.Process(target=_sleep_a_minute, daemon=True)
        proc.start()
        group = _WorkerGroup.__new__(_WorkerGroup)
        group._procs = [proc]
        group._lock = threading.Lock()
        group._reap_lock = threading.Lock()
        group._error, group._closed = None, False
        group._order, group._calls = deque(), {}
        messages: list[str] = []
        start = threading.Barrier(2)

        def reader() -> None:
            start.wait()
            messages.append(group._worker_exited(0))

        def checker() -> None:
            start.wait()
            with pytest.raises(RuntimeError) as e:
                group.check()
            messages.append(str(e.value))

        os.kill(proc.pid, signal.SIGKILL)
        # Both start from the fired sentinel, as in the engine.
        assert multiprocessing.connection.wait([proc.sentinel], 10)
        threads = [threading.Thread(target=reader), threading.Thread(target=checker)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(messages) == 2 and all("SIGKILL" in m for m in messages), messages
