"""Tests for vllm/v1/engine/core.py: EngineCore.step and step_with_batch_queue, driven by a
fake executor whose model calls run on a worker thread and log what happens when.

Overlap is proven by event order, never by timing: where a test must show that two things
run at once, one side waits (with a timeout that is recorded as a failure) for the other to
have started. Timings are only printed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.v1.core.sched_utils import (
    FakeStructuredOutputManager,
    GRAMMAR_END,
    default_policy,
    demo_model_config,
    make_config,
    make_request,
    pool_is_full,
    random_specs,
    wait_compiled,
)
from tests.v1.engine.fake_executor import FakeExecutor
from vllm.config import ModelConfig, VllmConfig
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.engine.core import EngineCore
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

# A hang check only (a gate that is reached is passed at once), so generous for a loaded CI
# machine; after one timeout no gate waits again, so a broken engine fails once, not per gate.
GATE_TIMEOUT_S = 60.0


@dataclass
class Event:
    """One logged moment: what happened, for which step, on which thread."""

    t: float
    kind: str
    step: int
    thread: str


@dataclass
class Recorder:
    """A thread-safe event log that threads can wait on."""

    events: list[Event] = field(default_factory=list)
    timeouts: list[str] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def log(self, kind: str, step: int) -> None:
        with self.cond:
            self.events.append(
                Event(time.monotonic(), kind, step, threading.current_thread().name))
            self.cond.notify_all()

    def has(self, kind: str, step: int) -> bool:
        return any(e.kind == kind and e.step == step for e in self.events)

    def wait_for(self, kind: str, step: int, why: str) -> None:
        """Blocks until (kind, step) is logged; records a timeout (a test failure) if not.
        After one timeout it no longer waits, so a broken engine fails fast."""
        with self.cond:
            if self.timeouts:
                return
            if not self.cond.wait_for(lambda: self.has(kind, step), GATE_TIMEOUT_S):
                self.timeouts.append(f"{why}: no {kind}({step}) after {GATE_TIMEOUT_S} s")

    def index(self, kind: str, step: int) -> int:
        """Position of the first (kind, step) event. Raises ValueError if there is none."""
        for i, e in enumerate(self.events):
            if e.kind == kind and e.step == step:
                return i
        raise ValueError(f"no event {kind}({step})")

    def time(self, kind: str, step: int) -> float:
        return self.events[self.index(kind, step)].t

    def steps(self, kind: str) -> list[int]:
        return [e.step for e in self.events if e.kind == kind]

    def engine_events(self) -> list[Event]:
        """The events logged by the engine (main) thread, in order."""
        return [e for e in self.events if e.thread == threading.main_thread().name]

    def engine_index(self, kind: str, step: int) -> int:
        """Position of (kind, step) among the engine thread's events."""
        for i, e in enumerate(self.engine_events()):
            if e.kind == kind and e.step == step:
                return i
        raise ValueError(f"no engine event {kind}({step})")


class RecordingExecutor(FakeExecutor):
    """The shared FakeExecutor (calls on a worker thread, like UniProcExecutor), logging every
    moment of its calls into a Recorder."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.rec = Recorder()

    def log(self, kind: str, step: int) -> None:
        self.rec.log(kind, step)


def executor_class(depth: int | None = None, forward_s: float = 0.0) -> type[RecordingExecutor]:
    """A RecordingExecutor subclass with the given pipeline depth and forward time."""
    attrs = {"depth": depth, "forward_s": forward_s}
    return type("RecordingExecutorK", (RecordingExecutor,), attrs)


@dataclass
class Setup:
    """An EngineCore over a RecordingExecutor, with the scheduler instrumented."""

    engine: EngineCore
    executor: RecordingExecutor
    rec: Recorder
    # Run on the engine thread at the start of update_from_output(step).
    before_update: Callable[[int], None] | None = None
    update_s: float = 0.0
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)

    def add(self, *requests: Request) -> None:
        """Adds requests and waits until their grammars are compiled (for determinism)."""
        for request in requests:
            self.engine.add_request(request)
            wait_compiled(request)

    def step(self) -> Any:
        """One step_fn call; collects its outputs."""
        outputs, executed = self.engine.step_fn()
        for out in outputs or []:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish[out.request_id] = out.finish_reason
        return outputs, executed

    def run(self, max_calls: int = 1000) -> None:
        """Steps until no request is unfinished and nothing is in flight."""
        engine = self.engine
        for _ in range(max_calls):
            if not (engine.scheduler.has_unfinished_requests() or engine.batch_queue):
                return
            self.step()
        raise AssertionError(f"engine not done after {max_calls} calls")


def _instrument(setup: Setup) -> None:
    """Wraps the scheduler's schedule / get_grammar_bitmask / update_from_output to log."""
    sched = setup.engine.scheduler
    rec = setup.rec
    schedule, bitmask, update = (
        sched.schedule, sched.get_grammar_bitmask, sched.update_from_output)

    def logged_schedule() -> SchedulerOutput:
        scheduler_output = schedule()
        rec.log("schedule", scheduler_output.step_id)
        return scheduler_output

    def logged_bitmask(scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        out = bitmask(scheduler_output)
        rec.log("bitmask", scheduler_output.step_id)
        return out

    def logged_update(scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> list:
        rec.log("update_start", scheduler_output.step_id)
        if setup.before_update is not None:
            setup.before_update(scheduler_output.step_id)
        time.sleep(setup.update_s)
        try:
            return update(scheduler_output, output)
        finally:
            rec.log("update_end", scheduler_output.step_id)

    sched.schedule = logged_schedule  # type: ignore[method-assign]
    sched.get_grammar_bitmask = logged_bitmask  # type: ignore[method-assign]
    sched.update_from_output = logged_update  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def model_config() -> ModelConfig:
    return demo_model_config()


MakeSetup = Callable[..., Setup]


@pytest.fixture
def make(model_config: ModelConfig) -> Iterator[MakeSetup]:
    """Builds engines over RecordingExecutors; at teardown every block is free, no grammar is
    live, and no wait at a gate timed out."""
    made: list[tuple[Setup, FakeStructuredOutputManager]] = []

    def _make(depth: int | None = None, forward_s: float = 0.0, **config: Any) -> Setup:
        vllm_config = make_config(model_config, **config)
        engine = EngineCore(vllm_config, executor_class=executor_class(depth, forward_s))
        # The engine has no tokenizer here; grammars come from the fake backend instead.
        engine.structured_output_manager.shutdown()
        som = FakeStructuredOutputManager(vllm_config)
        engine.structured_output_manager = som
        engine.scheduler.structured_output_manager = som
        executor = engine.model_executor
        assert isinstance(executor, RecordingExecutor)
        setup = Setup(engine, executor, executor.rec)
        _instrument(setup)
        made.append((setup, som))
        return setup

    yield _make
    try:
        for setup, som in made:
            assert not setup.rec.timeouts, setup.rec.timeouts
            assert not setup.engine.batch_queue
            assert pool_is_full(setup.engine.scheduler.kv_cache_manager)
            assert som.num_live_grammars == 0
    finally:
        for setup, _ in made:
            setup.engine.shutdown()


def expected(req_id: str, n: int) -> list[int]:
    return [default_policy(req_id, k) for k in range(n)]


def in_flight_profile(rec: Recorder) -> list[int]:
    """Batches launched and not yet given to update_from_output, after each engine event."""
    counts, n = [], 0
    for e in rec.engine_events():
        if e.kind == "exec_submit":
            n += 1
        elif e.kind == "update_start":
            n -= 1
        counts.append(n)
    return counts


# ---------------------------------------------------------------------- sync step


def test_sync_step_executes_then_bitmask_then_samples_then_updates(make: MakeSetup) -> None:
    s = make()
    assert s.engine.batch_queue_size == 1 and s.engine.step_fn == s.engine.step
    # Each forward waits until the engine has computed its bitmask: the bitmask must be
    # computed while the forward runs, not after it.
    s.executor.before_exec = lambda step: s.rec.wait_for("bitmask", step, "sync forward")
    s.add(make_request("g", 4, grammar="5 6 7"), make_request("p", 4, max_tokens=5))
    s.run()
    assert not s.rec.timeouts, s.rec.timeouts
    steps = s.rec.steps("schedule")
    assert len(steps) == 5
    for n in steps:
        order = [s.rec.index(k, n) for k in (
            "schedule", "exec_submit", "bitmask", "exec_end", "sample_submit", "sample_end",
            "update_start", "update_end")]
        assert order == sorted(order), f"step {n} out of order"
    assert s.tokens["g"] == [5, 6, 7, GRAMMAR_END] and s.finish["g"] == "stop"
    assert s.tokens["p"] == expected("p", 5)


# ---------------------------------------------------------------------- batch queue


def test_batch_queue_returns_before_the_queue_is_full(make: MakeSetup) -> None:
    s = make(async_scheduling=True)
    assert s.engine.batch_queue_size == 2
    assert s.engine.step_fn == s.engine.step_with_batch_queue
    release = threading.Event()
    s.executor.before_exec = lambda step: release.wait(GATE_TIMEOUT_S) if step == 1 else None
    s.add(make_request("p", 4, max_tokens=4))
    outputs, executed = s.step()
    # The forward of step 1 is still held: the engine did not wait for it.
    assert (outputs, executed) == (None, True)
    assert not s.rec.has("exec_end", 1) and not s.rec.has("update_start", 1)
    assert s.rec.has("exec_submit", 1) and s.rec.has("sample_submit", 1)
    # The second call launches step 2 before it waits for step 1.
    s.executor.before_exec = None

    # Step 1's forward goes on only once step 2 is submitted (not after a fixed delay, which
    # a stalled engine thread could outlast): an engine that waited for step 1 first would
    # record a gate timeout here and fail the order check below.
    def release_after_step_2_is_submitted() -> None:
        s.rec.wait_for("exec_submit", 2, "step 2 is launched while step 1 is held")
        release.set()

    threading.Thread(target=release_after_step_2_is_submitted, daemon=True).start()
    s.step()
    assert not s.rec.timeouts, s.rec.timeouts
    assert s.rec.index("exec_submit", 2) < s.rec.index("update_start", 1)
    s.run()
    assert s.tokens["p"] == expected("p", 4)


def test_forward_of_next_batch_overlaps_update(make: MakeSetup) -> None:
    """Forward N+1 runs during update_from_output(N): the update waits for the forward to
    have started and the forward waits for the update to have started."""
    k, f, c = 8, 0.03, 0.03
    s = make(async_scheduling=True, forward_s=f)
    s.update_s = c
    last = k  # one request, one sampled token per step: steps 1..k
    s.before_update = lambda n: (
        s.rec.wait_for("exec_start", n + 1, "update waits for next forward") if n < last else None)
    s.executor.before_exec = lambda n: (
        s.rec.wait_for("update_start", n - 1, "forward waits for update") if n > 1 else None)
    s.add(make_request("p", 4, max_tokens=k))
    t0 = time.monotonic()
    s.run()
    wall = time.monotonic() - t0
    assert not s.rec.timeouts, s.rec.timeouts
    for n in range(1, k):
        assert s.rec.index("exec_submit", n + 1) < s.rec.index("update_start", n)
        assert s.rec.index("exec_start", n + 1) < s.rec.index("update_end", n)
        assert s.rec.index("update_start", n) < s.rec.index("exec_end", n + 1)
    assert s.tokens["p"] == expected("p", k)
    print(f"\n{k} steps of forward {f * 1e3:.0f} ms + update {c * 1e3:.0f} ms: {wall * 1e3:.0f} ms "
          f"(serial {k * (f + c) * 1e3:.0f} ms, overlapped {k * max(f, c) * 1e3:.0f} ms)")


@pytest.mark.parametrize("depth", [3, 4])
def test_queue_of_depth_k_holds_k_batches(make: MakeSetup, depth: int) -> None:
    s = make(depth=depth, async_scheduling=True)
    assert s.engine.batch_queue_size == depth
    # The first forward is held until `depth` batches were launched.
    s.executor.before_exec = lambda n: (
        s.rec.wait_for("exec_submit", depth, "first forward waits for a full queue")
        if n == 1 else None)
    s.add(make_request("p", 4, max_tokens=10), make_request("q", 6, max_tokens=7))
    s.run()
    assert not s.rec.timeouts, s.rec.timeouts
    profile = in_flight_profile(s.rec)
    assert max(profile) == depth
    # Nothing is updated before the queue is full.
    assert s.rec.index("exec_submit", depth) < s.rec.index("update_start", 1)
    assert s.tokens["p"] == expected("p", 10) and s.tokens["q"] == expected("q", 7)


def test_deferred_sampling_waits_for_previous_update(make: MakeSetup) -> None:
    s = make(async_scheduling=True, forward_s=0.005)
    s.add(make_request("g", 4, grammar="5 6 7 8 9"), make_request("p", 5, max_tokens=8))
    pending: dict[int, bool] = {}
    schedule = s.engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        scheduler_output = schedule()
        if scheduler_output.total_num_scheduled_tokens:
            pending[scheduler_output.step_id] = scheduler_output.pending_structured_output_tokens
        return scheduler_output

    s.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    s.run()
    launched = s.rec.steps("exec_submit")
    assert True in pending.values() and False in pending.values()
    rec = s.rec
    for prev, n in zip(launched, launched[1:]):
        sample_at = rec.engine_index("sample_submit", n)
        if pending[n]:
            # Bitmask and sampling only after the previous batch's tokens were appended.
            assert rec.engine_index("update_end", prev) < rec.engine_index("bitmask", n)
            assert rec.engine_index("bitmask", n) < sample_at
        else:
            # Sampling is queued right behind the forward (after its bitmask), before any
            # older batch is updated.
            assert sample_at == rec.engine_index("exec_submit", n) + 2
            assert rec.engine_index("bitmask", n) == sample_at - 1
    assert s.tokens["g"] == [5, 6, 7, 8, 9, GRAMMAR_END] and s.finish["g"] == "stop"
    assert s.tokens["p"] == expected("p", 8)


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_structured_requests_arriving_mid_run_match_sync(make: MakeSetup, depth: int) -> None:
    """Requests arrive one per engine call, so batches with and without pending grammar
    tokens alternate in the queue; outputs must equal the sync engine's and the worker must
    always sample a step before it runs the next forward."""
    specs, special = random_specs(depth, 8, 14)

    def policy(r: str, k: int) -> int:
        return special.get(r, {}).get(k, default_policy(r, k))

    results = {}
    for async_scheduling in (False, True):
        s = make(depth=depth if async_scheduling else None, async_scheduling=async_scheduling,
                 num_blocks=12, block_size=4, max_num_batched_tokens=12)
        s.executor.runner.policy = policy
        for req_id, prompt, kwargs in specs:
            s.add(make_request(req_id, prompt, **kwargs))
            s.step()
        s.run()
        results[async_scheduling] = (s.tokens, s.finish)
    assert results[True] == results[False]


@pytest.mark.parametrize("depth", [2, 3])
def test_abort_with_batches_in_flight(make: MakeSetup, depth: int) -> None:
    s = make(depth=depth, async_scheduling=True)
    s.add(make_request("a", 4, max_tokens=20), make_request("p", 4, max_tokens=12))
    for _ in range(depth - 1):
        assert s.step() == (None, True)
    assert len(s.engine.batch_queue) == depth - 1  # all of them sample a
    s.engine.abort_requests(["a"])
    a_tokens = list(s.tokens.get("a", []))
    s.add(make_request("g", 4, grammar="1 2 3 4 5 6"))
    while "g" not in s.engine.batch_queue.newest.scheduler_output.num_scheduled_tokens:
        s.step()
    s.step()
    g = s.engine.scheduler.requests["g"]
    assert g.num_output_placeholders > 0  # a token of g is in flight
    s.engine.abort_requests(["g"])
    g_tokens = list(s.tokens.get("g", []))
    s.run()
    assert s.tokens.get("a", []) == a_tokens and s.tokens.get("g", []) == g_tokens
    assert g_tokens == [1, 2, 3, 4, 5, 6][: len(g_tokens)]
    assert s.tokens["p"] == expected("p", 12)
    assert "a" not in s.finish and "g" not in s.finish
    # Both aborts found their request alive; repeating one, or an unknown id, counts nothing.
    s.engine.abort_requests(["a", "never-added"])
    stats = s.engine.make_stats()
    assert stats.num_aborted_requests == 2
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv.num_free_blocks == stats.kv.num_blocks == s.engine.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_goes_idle_after_the_last_request(
    make: MakeSetup, async_scheduling: bool
) -> None:
    s = make(async_scheduling=async_scheduling)
    s.add(make_request("p", 4, max_tokens=3))
    s.run()
    # Telling the runner about the finished request may take one more call, not more.
    for _ in range(3):
        if not s.engine.has_work():
            break
        s.step()
    assert not s.engine.has_work(), "the engine never becomes idle: has_work() stays True"
    assert s.executor.runner.reqs == {}, "the runner was never told that p finished"


def test_a_draft_model_that_cannot_serve_stops_the_workers(model_config: ModelConfig,
                                                           tmp_path) -> None:
    """The scheduler is built after the workers started: its failure (here a draft model
    of another vocabulary) must shut them down, not leave them running."""
    from tests.utils_models import build_checkpoint
    from vllm.config import SpeculativeConfig

    build_checkpoint("qwen3", tmp_path, seed=1)  # a 512-token vocabulary
    vllm_config = make_config(model_config)
    vllm_config.speculative_config = SpeculativeConfig(method="draft_model", model=str(tmp_path))
    shutdowns: list[bool] = []

    class Recording(FakeExecutor):
        def shutdown(self) -> None:
            shutdowns.append(True)
            super().shutdown()

    with pytest.raises(ValueError, match="vocabulary has 512 tokens"):
        EngineCore(vllm_config, executor_class=Recording)
    assert shutdowns == [True]


def test_the_draft_model_loads_before_the_kv_cache_is_sized(model_config: ModelConfig,
                                                            monkeypatch) -> None:
    """On a GPU the KV cache takes the memory left when it is sized: the draft model and its
    cache must already hold theirs, or the draft model's allocation runs out of memory."""
    from vllm.v1.engine import core as core_module

    events: list[str] = []
    built = object()

    def build_proposer(config):
        events.append("proposer")
        return built

    class Recording(FakeExecutor):
        def determine_num_blocks(self) -> int:
            events.append("determine_num_blocks")
            return super().determine_num_blocks()

    monkeypatch.setattr(core_module, "build_proposer", build_proposer)
    engine = EngineCore(make_config(model_config), executor_class=Recording)
    try:
        assert events == ["proposer", "determine_num_blocks"]
        assert engine.scheduler.drafter.proposer is built
    finally:
        engine.shutdown()
