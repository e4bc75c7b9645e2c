"""Tests for vllm/v1/core/sched/request_queue.py: the waiting queue and running order of each
--scheduling-policy, driven through the scheduler (sync and async) with fake model outputs,
and the prefix-cache salt a request's `cache_salt` adds to its adapter's."""

from __future__ import annotations

import pytest

from tests.v1.core.sched_utils import (
    MakeHarness,
    Harness,
    default_policy,
    make_request,
)
from vllm.lora.request import LoRARequest
from vllm.v1.core.kv_cache_utils import block_hash_salt
from vllm.v1.core.sched.request_queue import (
    FCFSWaitingQueue,
    PriorityWaitingQueue,
    make_waiting_queue,
)

MODES = [False, True]  # async scheduling off / on


def first_steps(h: Harness) -> dict[str, int]:
    """Runs the harness to the end; returns each request's first scheduled step."""
    h.run()
    return {r: steps[0] for r, steps in h.steps_of.items()}


def finish_steps(h: Harness) -> dict[str, int]:
    """Runs the harness to the end; returns the step each request finished in (the number
    of update calls so far when its finishing output arrived)."""
    finished: dict[str, int] = {}
    updates = 0
    while h.sched.has_unfinished_requests() or h.in_flight:
        before = {r: len(o) for r, o in h.outputs.items()}
        h.step()
        updates += 1
        for r, outs in h.outputs.items():
            if len(outs) != before.get(r, 0) and outs[-1].finish_reason is not None:
                finished.setdefault(r, updates)
        assert updates < 500
    return finished


# ---------------------------------------------------------------------- the queues alone


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    reqs = [make_request(name, 2, priority=p)
            for name, p in (("a", 5), ("b", 0), ("c", 5), ("d", -3), ("e", 0))]
    queue = make_waiting_queue("priority")
    assert isinstance(queue, PriorityWaitingQueue)
    for r in reqs:
        queue.add(r)
    assert [r.request_id for r in queue] == ["d", "b", "e", "a", "c"]
    assert queue.peek() is reqs[3] and queue[1] is reqs[1] and len(queue) == 5
    queue.remove(reqs[1])
    assert reqs[1] not in queue and reqs[4] in queue
    head = [queue.pop(), queue.pop()]
    assert [r.request_id for r in head] == ["d", "e"]
    # Put back (a skipped head) and requeued (a preempted request) go to their place.
    queue.restore(head)
    queue.requeue(reqs[1])
    assert [r.request_id for r in queue] == ["d", "b", "e", "a", "c"]
    with pytest.raises(ValueError):
        queue.remove(make_request("x", 2))


def test_fcfs_queue_keeps_arrival_order_and_puts_preempted_first() -> None:
    reqs = [make_request(name, 2, priority=p) for name, p in (("a", 5), ("b", 0), ("c", 1))]
    queue = make_waiting_queue("fcfs")
    assert isinstance(queue, FCFSWaitingQueue)
    for r in reqs:
        queue.add(r)
    assert [r.request_id for r in queue] == ["a", "b", "c"]
    head = queue.pop()
    preempted = make_request("p", 2, priority=9)
    queue.requeue(preempted)
    queue.restore([head])
    assert [r.request_id for r in queue] == ["a", "p", "b", "c"]


# ---------------------------------------------------------------------- through the scheduler


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order_follows_the_policy(
    make: MakeHarness, policy: str, async_scheduling: bool
) -> None:
    h = make(max_num_seqs=1, scheduling_policy=policy, async_scheduling=async_scheduling)
    h.add(*(make_request(f"low{i}", 3, max_tokens=3, priority=5) for i in range(3)))
    h.step()  # low0 takes the only slot
    assert [r.request_id for r in h.sched.running] == ["low0"]
    h.add(make_request("high", 3, max_tokens=3, priority=-1),
          make_request("mid", 3, max_tokens=3, priority=5))
    first = first_steps(h)
    order = sorted(first, key=first.get)
    if policy == "priority":
        assert order == ["low0", "high", "low1", "low2", "mid"]
    else:
        assert order == ["low0", "low1", "low2", "high", "mid"]
    for r in first:
        assert h.tokens[r] == [default_policy(r, k) for k in range(3)]


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim_follows_the_policy(
    make: MakeHarness, policy: str, async_scheduling: bool
) -> None:
    # Two requests that each grow to 4 blocks of 4 tokens, in a pool of 6: one must go.
    h = make(num_blocks=6, block_size=4, scheduling_policy=policy,
             async_scheduling=async_scheduling)
    h.add(make_request("low", 6, max_tokens=10, priority=5))
    h.step()
    h.add(make_request("high", 6, max_tokens=10, priority=0))
    victims = []
    finished = finish_steps(h)
    for scheduler_output in h.runner.steps:
        victims += sorted(scheduler_output.preempted_req_ids)
    assert victims, "the workload must force preemption"
    # fcfs preempts the newest running request, priority the lowest-priority one.
    expected_victim = "low" if policy == "priority" else "high"
    assert set(victims) == {expected_victim}
    assert h.added[expected_victim].num_preemptions >= 1
    survivor = "high" if policy == "priority" else "low"
    assert h.added[survivor].num_preemptions == 0
    assert finished[survivor] < finished[expected_victim]
    for r in ("low", "high"):
        assert h.tokens[r] == [default_policy(r, k) for k in range(10)]


@pytest.mark.parametrize("async_scheduling", MODES)
def test_running_requests_are_scheduled_by_priority(
    make: MakeHarness, async_scheduling: bool
) -> None:
    h = make(scheduling_policy="priority", async_scheduling=async_scheduling)
    h.add(make_request("b", 2, max_tokens=6, priority=3),
          make_request("a", 2, max_tokens=6, priority=3))
    h.step()
    # Admitted while b and a run: it goes before them, which keep their arrival order.
    h.add(make_request("c", 2, max_tokens=6, priority=1))
    h.step()
    assert [r.request_id for r in h.sched.running] == ["c", "b", "a"]
    # The next step schedules them in that order.
    scheduler_output = h.schedule()
    assert list(scheduler_output.num_scheduled_tokens) == ["c", "b", "a"]
    h.run()


# ---------------------------------------------------------------------- cache_salt


def test_cache_salt_separates_prefix_cache_hits(make: MakeHarness) -> None:
    h = make(block_size=4)
    prompt = list(range(500, 513))  # 3 full blocks and one token
    runs = [("plain", None), ("a1", "a"), ("b1", "b"), ("a2", "a"), ("plain2", None)]
    cached = {}
    for req_id, salt in runs:
        h.add(make_request(req_id, prompt, max_tokens=1, cache_salt=salt))
        h.run()
        cached[req_id] = h.added[req_id].num_cached_tokens
    # Only requests of the same salt (or both without one) share blocks.
    assert cached == {"plain": 0, "a1": 0, "b1": 0, "a2": 12, "plain2": 12}


def test_cache_salt_holds_without_a_lookup(make: MakeHarness) -> None:
    # A request that wants prompt logprobs skips the lookup but still registers its blocks:
    # under its own salt, so an unsalted request with the same prompt finds none of them.
    h = make(block_size=4)
    prompt = list(range(600, 613))
    h.add(make_request("salted", prompt, max_tokens=1, cache_salt="s", prompt_logprobs=0))
    h.run()
    h.add(make_request("plain", prompt, max_tokens=1))
    h.run()
    assert h.added["plain"].num_cached_tokens == 0
    h.add(make_request("same", prompt, max_tokens=1, cache_salt="s"))
    h.run()
    assert h.added["same"].num_cached_tokens == 12


def test_cache_salt_combines_with_the_adapter_salt() -> None:
    lora = LoRARequest("x", 1, "/adapters/x").cache_salt
    salts = {
        block_hash_salt(None, None), block_hash_salt(lora, None), block_hash_salt(None, "s"),
        block_hash_salt(lora, "s"), block_hash_salt(lora, "t"),
    }
    assert len(salts) == 5
    assert block_hash_salt(None, None) is None and block_hash_salt(lora, None) == lora
    assert block_hash_salt(lora, "s") == block_hash_salt(lora, "s")
