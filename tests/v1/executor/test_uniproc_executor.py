"""Tests for vllm/v1/executor/uniproc_executor.py: calls run in order on the worker thread,
and a sampling result is handed over once the forward queued behind it has started.

A fake Worker stands in for the model: its execute_model stops at gates the test opens, so
every check is an event order, never a timing.
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError
from types import SimpleNamespace

import pytest

from tests.v1.core.sched_utils import demo_model_config, make_config
from vllm.v1.executor.uniproc_executor import UniProcExecutor

TIMEOUT_S = 30.0


class FakeWorker:
    """Steps whose input preparation and forward each wait for a gate of the test."""

    def __init__(self, vllm_config) -> None:
        self.model_runner = SimpleNamespace(on_forward_start=None)
        self.prepare_gates: dict[int, threading.Event] = {}
        self.forward_gates: dict[int, threading.Event] = {}
        self.reached: dict[str, threading.Event] = {}
        self.fail_prepare: set[int] = set()
        self.fail_sample: set[int] = set()
        self.samples = 0

    def load_model(self) -> None:
        pass

    def gate(self, gates: dict[int, threading.Event], step: int) -> threading.Event:
        return gates.setdefault(step, threading.Event())

    def arrived(self, what: str) -> threading.Event:
        return self.reached.setdefault(what, threading.Event())

    def execute_model(self, step: int) -> str:
        self.arrived(f"prepare {step}").set()
        assert self.gate(self.prepare_gates, step).wait(TIMEOUT_S)
        if step in self.fail_prepare:
            raise ValueError(f"step {step} failed before its forward")
        if self.model_runner.on_forward_start is not None:
            self.model_runner.on_forward_start()
        self.arrived(f"forward {step}").set()
        assert self.gate(self.forward_gates, step).wait(TIMEOUT_S)
        return f"executed {step}"

    def sample_tokens(self, grammar_output) -> str:
        self.samples += 1
        if self.samples in self.fail_sample:
            raise RuntimeError(f"sample {self.samples} failed")
        return f"sampled {self.samples}"


@pytest.fixture()
def executor(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("vllm.v1.worker.gpu_worker.Worker", FakeWorker)
    executor = UniProcExecutor(make_config(demo_model_config(), async_scheduling=True))
    yield executor
    for gates in (executor.worker.prepare_gates, executor.worker.forward_gates):
        for gate in gates.values():
            gate.set()
    executor.shutdown()


def open_step(worker: FakeWorker, step: int) -> None:
    worker.gate(worker.prepare_gates, step).set()
    worker.gate(worker.forward_gates, step).set()


def test_a_sample_is_handed_over_when_the_next_forward_starts(executor) -> None:
    worker: FakeWorker = executor.worker
    first = executor.execute_model(1, non_block=True)
    sample = executor.sample_tokens(None, non_block=True)
    second = executor.execute_model(2, non_block=True)
    open_step(worker, 1)
    assert worker.arrived("prepare 2").wait(TIMEOUT_S)
    # The worker prepares step 2 while the engine thread still waits: it would otherwise
    # contend with the engine's work on sample 1 for the interpreter lock.
    assert first.result(TIMEOUT_S) == "executed 1"
    assert not sample.done()
    worker.gate(worker.prepare_gates, 2).set()
    assert sample.result(TIMEOUT_S) == "sampled 1"
    # Handed over while step 2's forward still runs.
    assert not second.done()
    worker.gate(worker.forward_gates, 2).set()
    assert second.result(TIMEOUT_S) == "executed 2"


def test_a_sample_with_no_forward_behind_it_is_handed_over_at_once(executor) -> None:
    worker: FakeWorker = executor.worker
    open_step(worker, 1)
    executor.execute_model(1, non_block=True)
    assert executor.sample_tokens(None, non_block=True).result(TIMEOUT_S) == "sampled 1"
    assert executor.sample_tokens(None) == "sampled 2"  # blocking calls too


def test_a_step_that_fails_before_its_forward_still_hands_over(executor) -> None:
    worker: FakeWorker = executor.worker
    worker.fail_prepare.add(2)
    executor.execute_model(1, non_block=True)
    sample = executor.sample_tokens(None, non_block=True)
    second = executor.execute_model(2, non_block=True)
    open_step(worker, 1)
    worker.gate(worker.prepare_gates, 2).set()
    assert sample.result(TIMEOUT_S) == "sampled 1"
    with pytest.raises(ValueError, match="step 2 failed before its forward"):
        second.result(TIMEOUT_S)


def test_held_samples_are_handed_over_in_order_and_errors_pass_through(executor) -> None:
    worker: FakeWorker = executor.worker
    worker.fail_sample.add(2)
    executor.execute_model(1, non_block=True)
    first = executor.sample_tokens(None, non_block=True)
    executor.execute_model(2, non_block=True)
    second = executor.sample_tokens(None, non_block=True)
    third_step = executor.execute_model(3, non_block=True)
    third = executor.sample_tokens(None, non_block=True)
    for step in (1, 2, 3):
        open_step(worker, step)
    assert first.result(TIMEOUT_S) == "sampled 1"
    with pytest.raises(RuntimeError, match="sample 2 failed"):
        second.result(TIMEOUT_S)
    assert third_step.result(TIMEOUT_S) == "executed 3"
    assert third.result(TIMEOUT_S) == "sampled 3"


def test_shutdown_cancels_queued_samples_and_hands_over_held_ones(executor) -> None:
    worker: FakeWorker = executor.worker
    executor.execute_model(1, non_block=True)
    held = executor.sample_tokens(None, non_block=True)
    executor.execute_model(2, non_block=True)
    queued = executor.sample_tokens(None, non_block=True)
    open_step(worker, 1)
    assert worker.arrived("prepare 2").wait(TIMEOUT_S)
    stopper = threading.Thread(target=executor.shutdown)
    stopper.start()
    # Shutdown waits for the running call (step 2) and cancels the sample queued behind it.
    with pytest.raises(CancelledError):
        queued.result(TIMEOUT_S)
    worker.fail_prepare.add(2)  # step 2 ends without its forward
    worker.gate(worker.prepare_gates, 2).set()
    stopper.join(TIMEOUT_S)
    assert not stopper.is_alive()
    assert held.result(TIMEOUT_S) == "sampled 1"
