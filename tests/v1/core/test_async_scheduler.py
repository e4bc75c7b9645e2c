"""Tests for vllm/v1/core/sched/async_scheduler.py: steps scheduled before the previous
step's tokens are known (one or two steps in flight), with fake model outputs.

The Harness checks after every call that each live request's placeholder count equals what
the in-flight steps that sample it may still give (one each, plus their drafts), that `pending_structured_output_tokens` is set
exactly when a scheduled structured request waits for an in-flight token, and that KV block
ownership matches the live requests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tests.v1.core.sched_utils import (
    MakeHarness,
    CYCLE,
    SPEC_CONDITIONS,
    cyclic,
    harness_factory,
    spec_workload,
    EOS,
    GRAMMAR_END,
    Harness,
    default_policy,
    make_request,
)
from vllm.config import ModelConfig
from vllm.reasoning import PARSERS, ReasoningParser
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.core.kv_cache_utils import hash_block_tokens
from vllm.v1.request import Request, RequestStatus

ABORTED = RequestStatus.FINISHED_ABORTED


@pytest.fixture
def make(model_config: ModelConfig) -> Iterator[MakeHarness]:
    """Builds harnesses (async unless async_scheduling=False is passed); at teardown every
    request is gone, nothing is in flight and the KV pool is full."""
    with harness_factory(model_config, async_scheduling=True) as factory:
        yield factory


def expected(req_id: str, n: int) -> list[int]:
    """The first n tokens the default policy samples for req_id."""
    return [default_policy(req_id, k) for k in range(n)]


def special_policy(special: dict[str, dict[int, int]]) -> Callable[[str, int], int]:
    """The default policy, except output k of request r is special[r][k] where given."""
    return lambda r, k: special.get(r, {}).get(k, default_policy(r, k))


def num_sampling_steps(h: Harness, req_id: str) -> int:
    """Steps the runner sampled `req_id` in."""
    return sum(req_id in scheduler_output.sampled_req_ids for scheduler_output in h.runner.steps)


# ---------------------------------------------------------------------- max_tokens, max_model_len


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("budget", [64, 4], ids=["whole_prefill", "chunked_prefill"])
def test_max_tokens_schedules_exactly_prompt_plus_max_tokens_minus_one(
    make: MakeHarness, depth: int, budget: int
) -> None:
    h = make(depth=depth, max_num_batched_tokens=budget, max_num_seqs=4)
    lengths = {"a": (10, 6), "b": (3, 1), "c": (5, 9)}
    h.add(*(make_request(r, p, max_tokens=m) for r, (p, m) in lengths.items()))
    h.run()
    for r, (p, m) in lengths.items():
        assert h.scheduled[r] == p + m - 1
        assert num_sampling_steps(h, r) == m, "scheduled a token past max_tokens"
        assert h.tokens[r] == expected(r, m)
        assert h.finish_reason(r) == "length"
        assert h.added[r].num_output_placeholders == 0


@pytest.mark.parametrize("depth", [2, 3])
def test_never_schedules_past_max_model_len(make: MakeHarness, depth: int) -> None:
    h = make(depth=depth, max_model_len=12)
    h.add(make_request("r", 8, max_tokens=None), make_request("s", 11, max_tokens=None))
    h.run()
    assert h.tokens["r"] == expected("r", 4) and h.finish_reason("r") == "length"
    assert h.tokens["s"] == expected("s", 1) and h.finish_reason("s") == "length"
    assert h.scheduled["r"] == h.scheduled["s"] == 11
    assert num_sampling_steps(h, "r") == 4 and num_sampling_steps(h, "s") == 1


# ---------------------------------------------------------------------- stop checks


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize(
    "params, special",
    [
        pytest.param({"max_tokens": 10}, {2: EOS}, id="eos"),
        pytest.param({"max_tokens": 10, "stop_token_ids": [777]}, {1: 777}, id="stop_token_id"),
        pytest.param({"max_tokens": 10, "min_tokens": 3}, {1: EOS, 4: EOS},
                     id="eos_before_min_tokens"),
        pytest.param({"max_tokens": 10, "ignore_eos": True}, {1: EOS}, id="ignore_eos"),
    ],
)
def test_stop_checks_match_sync(
    make: MakeHarness, depth: int, params: dict, special: dict[int, int]
) -> None:
    policy = special_policy({"r": special})
    runs = {}
    for async_scheduling in (False, True):
        h = make(async_scheduling=async_scheduling, depth=depth if async_scheduling else 1,
                 policy=policy)
        h.add(make_request("r", 6, **params), make_request("o", 5, max_tokens=12))
        h.run()
        runs[async_scheduling] = h
    sync, asyn = runs[False], runs[True]
    assert asyn.tokens == sync.tokens
    for r in ("r", "o"):
        assert [(o.finish_reason, o.stop_reason) for o in asyn.outputs[r]] == [
            (o.finish_reason, o.stop_reason) for o in sync.outputs[r]
        ]
        # A stop wastes at most the steps that were already in flight.
        assert sync.scheduled[r] <= asyn.scheduled[r] <= sync.scheduled[r] + depth - 1


def test_eos_while_next_step_in_flight(make: MakeHarness) -> None:
    h = make(policy=special_policy({"r": {2: EOS}}))
    h.add(make_request("r", 4, max_tokens=10), make_request("o", 4, max_tokens=6))
    h.schedule()
    h.schedule()
    h.update()
    h.schedule()
    h.update()
    so4 = h.schedule()  # samples r's 4th token, which will never be used
    assert "r" in so4.sampled_req_ids
    outs = h.update()  # r's 3rd token: EOS
    (out_r,) = [o for o in outs if o.request_id == "r"]
    assert out_r.new_token_ids == [EOS] and out_r.finish_reason == "stop"
    assert "r" not in h.sched.requests
    assert h.kv.get_block_ids("r") == [], "blocks of a finished request must be freed at once"
    so5 = h.schedule()
    assert "r" in so5.finished_req_ids and "r" not in so5.num_scheduled_tokens
    outs = h.update()  # so4: r's late token is dropped
    assert all(o.request_id != "r" for o in outs)
    h.run()
    assert h.tokens["r"] == expected("r", 2) + [EOS]
    assert h.tokens["o"] == expected("o", 6)


# ---------------------------------------------------------------------- aborts


@pytest.mark.parametrize("num_in_flight", [1, 2])
def test_abort_running_request_with_steps_in_flight(
    make: MakeHarness, num_in_flight: int
) -> None:
    h = make(depth=3)
    h.add(make_request("r", 5, max_tokens=10), make_request("o", 5, max_tokens=6))
    h.schedule()
    h.schedule()
    if num_in_flight == 1:
        h.update()
    assert h.added["r"].num_output_placeholders == num_in_flight
    tokens_before = list(h.tokens.get("r", []))
    free_before = h.kv.num_free_blocks
    num_r = len(h.kv.get_block_ids("r"))
    h.sched.finish_requests(["r"], ABORTED)
    assert h.kv.num_free_blocks == free_before + num_r
    h.drain()  # late outputs of r are dropped without error
    h.check()
    scheduler_output = h.schedule()
    assert "r" in scheduler_output.finished_req_ids
    h.run()
    assert h.tokens.get("r", []) == tokens_before
    assert h.tokens["o"] == expected("o", 6)


@pytest.mark.parametrize("num_speculative_tokens", [0, 3])
def test_an_aborted_id_reused_while_its_step_is_in_flight(
    make: MakeHarness, num_speculative_tokens: int
) -> None:
    """The late output of an aborted request must not reach the new request that took its
    id (before: its tokens were appended to the new request, and its placeholders taken
    from it, failing an assertion that ended the engine)."""
    h = make(depth=3, num_speculative_tokens=num_speculative_tokens)
    h.add(make_request("r", CYCLE * 3, max_tokens=20), make_request("o", CYCLE * 3, max_tokens=20))
    h.schedule()
    h.update()
    assert "r" in h.schedule().sampled_req_ids  # in flight
    h.sched.finish_requests(["r"], ABORTED)
    h.schedule()  # tells the runner that r finished
    new = make_request("r", [7, 8, 9, 10, 11], max_tokens=3)
    h.add(new)
    outs = h.update()  # the old r's step
    assert all(o.request_id != "r" for o in outs)
    assert new.num_output_tokens == 0 and new.num_output_placeholders == 0
    h.run()
    assert new.num_output_tokens == 3 and new.is_finished()
    assert h.tokens["o"] == [default_policy("o", k) for k in range(20)]


# ---------------------------------------------------------------------- preemption


def _preempt_y(h: Harness, num_in_flight: int, **y_params: object) -> None:
    """x and y (7-token prompts, 4 blocks of 4 tokens) run until x's 9th token needs a
    third block: y, admitted last, is preempted with `num_in_flight` steps in flight."""
    y_params.setdefault("max_tokens", 10)
    h.add(make_request("x", 7, max_tokens=10), make_request("y", 7, **y_params))
    h.schedule()
    h.schedule()
    if num_in_flight == 1:
        h.update()
    scheduler_output = h.schedule()
    assert scheduler_output.preempted_req_ids == {"y"}
    assert "x" in scheduler_output.num_scheduled_tokens and "y" not in scheduler_output.num_scheduled_tokens
    y = h.added["y"]
    assert y.status == RequestStatus.PREEMPTED and y.num_output_placeholders == num_in_flight
    assert h.sched.waiting[0] is y and h.kv.get_block_ids("y") == []


def _resumed_steps(h: Harness, req_id: str) -> list[int]:
    """Indexes into h.runner.steps of the steps that resumed `req_id`."""
    return [
        n for n, scheduler_output in enumerate(h.runner.steps)
        for i, r in enumerate(scheduler_output.scheduled_cached_reqs.req_ids)
        if r == req_id and scheduler_output.scheduled_cached_reqs.resumed_from_preemption[i]
    ]


@pytest.mark.parametrize("num_in_flight", [1, 2])
def test_preempted_request_resumes_after_its_in_flight_tokens(
    make: MakeHarness, num_in_flight: int
) -> None:
    h = make(depth=num_in_flight + 1, num_blocks=4, block_size=4)
    _preempt_y(h, num_in_flight)
    y = h.added["y"]
    # Free every block, so only the in-flight tokens can hold y back.
    h.sched.finish_requests(["x"], ABORTED)
    n_steps = len(h.runner.steps)
    while y.num_output_placeholders:
        h.step()
        assert all("y" not in scheduler_output.num_scheduled_tokens for scheduler_output in h.runner.steps[n_steps:]), (
            "y resumed before its in-flight tokens arrived")
    # y sampled in the first two steps either way; some of them landed after preemption.
    assert y.output_token_ids == expected("y", 2)
    h.step()
    (n,) = _resumed_steps(h, "y")
    scheduler_output = h.runner.steps[n]
    cached = scheduler_output.scheduled_cached_reqs
    assert cached.resumed_req_token_ids["y"] == y.prompt_token_ids + expected("y", 2)
    assert cached.resumed_num_output_tokens["y"] == 2
    assert "y" in scheduler_output.sampled_req_ids
    h.run()
    assert h.tokens["y"] == expected("y", 10)


@pytest.mark.parametrize("num_in_flight", [1, 2])
@pytest.mark.parametrize("stop", ["eos", "max_tokens"])
def test_preempted_request_finished_by_its_late_token(
    make: MakeHarness, num_in_flight: int, stop: str
) -> None:
    h = make(depth=num_in_flight + 1, num_blocks=4, block_size=4,
             policy=special_policy({"y": {1: EOS}} if stop == "eos" else {}))
    _preempt_y(h, num_in_flight, max_tokens=10 if stop == "eos" else 2)
    h.drain()
    assert "y" not in h.sched.requests and h.added["y"] not in h.sched.waiting
    assert h.finish_reason("y") == ("stop" if stop == "eos" else "length")
    assert h.tokens["y"] == ([default_policy("y", 0), EOS] if stop == "eos" else expected("y", 2))
    h.run()
    assert _resumed_steps(h, "y") == []
    assert h.tokens["x"] == expected("x", 10)


# One token in flight only: y's second in-flight step would be deferred (its structured
# token is pending), and until that step is sampled nothing that samples in it (x included)
# is scheduled, so nothing can preempt y then (AsyncScheduler._waits_for_sampling).
@pytest.mark.parametrize("num_in_flight", [1])
def test_structured_request_preempted_with_token_in_flight(
    make: MakeHarness, num_in_flight: int
) -> None:
    h = make(depth=num_in_flight + 1, num_blocks=4, block_size=4)
    seq = list(range(21, 30))
    _preempt_y(h, num_in_flight, grammar=" ".join(map(str, seq)), max_tokens=None)
    h.sched.finish_requests(["x"], ABORTED)
    h.run()
    assert len(_resumed_steps(h, "y")) == 1
    assert h.tokens["y"] == seq + [GRAMMAR_END] and h.finish_reason("y") == "stop"


SCENARIOS = {
    # Events after y (the latest request) was preempted with steps in flight.
    "preempt_abort_late": ["abort y", "drain"],
    "preempt_late_abort": ["drain", "abort y"],
    "preempt_late_resume_abort": ["abort x", "drain", "step", "step", "abort y"],
    "preempt_abort_survivor": ["abort x", "drain"],
    "preempt_abort_both": ["abort x", "abort y", "drain"],
    "preempt_abort_survivor_while_resumed": ["drain", "step", "step", "abort x"],
}


@pytest.mark.parametrize("num_in_flight", [1, 2])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_abort_and_preemption_in_every_order(
    make: MakeHarness, scenario: str, num_in_flight: int
) -> None:
    h = make(depth=num_in_flight + 1, num_blocks=4, block_size=4)
    _preempt_y(h, num_in_flight)
    aborted: dict[str, list[int]] = {}
    for event in SCENARIOS[scenario]:
        if event.startswith("abort"):
            req_id = event.split()[1]
            h.sched.finish_requests([req_id], ABORTED)
            aborted[req_id] = list(h.tokens.get(req_id, []))
            assert h.kv.get_block_ids(req_id) == []
        elif event == "drain":
            h.drain()
        else:
            h.step()
        h.check()
    h.run()
    for r in ("x", "y"):
        if r in aborted:
            assert h.tokens.get(r, []) == aborted[r], f"{r} produced output after its abort"
            assert aborted[r] == expected(r, len(aborted[r]))
        else:
            assert h.tokens[r] == expected(r, 10)
            assert h.finish_reason(r) == "length"


def test_abort_victim_before_it_is_preempted(make: MakeHarness) -> None:
    h = make(depth=2, num_blocks=4, block_size=4)
    h.add(make_request("x", 7, max_tokens=10), make_request("y", 7, max_tokens=10))
    h.schedule()
    h.schedule()
    h.update()
    h.sched.finish_requests(["y"], ABORTED)  # x's third block now comes from y's blocks
    h.run()
    assert h.sched.num_preemptions == 0
    assert h.tokens["x"] == expected("x", 10)


# ---------------------------------------------------------------------- structured outputs


def test_pending_structured_output_tokens(make: MakeHarness) -> None:
    """The harness asserts the flag's exact value at every schedule; this run makes it take
    both values and checks that deferred bitmasks still lead to the grammar's tokens."""
    h = make(depth=2, max_num_batched_tokens=8)
    h.add(make_request("p", 6, max_tokens=3), make_request("g1", 5, grammar="5 6 7 8"),
          make_request("g2", 12, grammar="9 10"))
    flags = []
    while h.step():
        flags.append(h.runner.steps[-1].pending_structured_output_tokens)
    assert True in flags and False in flags
    assert h.tokens["g1"] == [5, 6, 7, 8, GRAMMAR_END] and h.finish_reason("g1") == "stop"
    assert h.tokens["g2"] == [9, 10, GRAMMAR_END]
    assert h.tokens["p"] == expected("p", 3)


@pytest.mark.parametrize("depth", [2, 3])
def test_grammar_that_cannot_advance_ends_only_its_request(
    make: MakeHarness, depth: int
) -> None:
    h = make(depth=depth)
    h.add(make_request("g1", 5, grammar="5 6 7"), make_request("g2", 5, grammar="5 6 7"),
          make_request("p", 5, max_tokens=6))
    h.runner.force[("g1", 1)] = 9  # the grammar allows only 6 here
    h.run()
    assert h.finish_reason("g1") == "error" and "rejected" in (h.outputs["g1"][-1].error or "")
    assert h.tokens["g1"] == [5]
    assert h.tokens["g2"] == [5, 6, 7, GRAMMAR_END] and h.finish_reason("g2") == "stop"
    assert h.tokens["p"] == expected("p", 6)


# ---------------------------------------------------------------------- prefix caching


def _confirmed_block_hashes(requests: list[Request], block_size: int) -> set[int]:
    hashes: set[int] = set()
    for request in requests:
        parent = None
        tokens = request.all_token_ids
        for i in range(len(tokens) // block_size):
            parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size])
            hashes.add(parent)
    return hashes


@pytest.mark.parametrize("depth", [2, 3])
def test_prefix_cache_holds_only_confirmed_tokens(make: MakeHarness, depth: int) -> None:
    h = make(depth=depth, block_size=4)
    h.add(make_request("r", 3, max_tokens=12), make_request("s", 6, max_tokens=5))
    while h.step():
        confirmed = _confirmed_block_hashes(list(h.added.values()), 4)
        for block_hash in h.kv.pool.cached:
            assert block_hash in confirmed, "a block with an unconfirmed token was cached"
    r = h.added["r"]
    # Once confirmed, r's outputs are cached: a request repeating them hits two blocks.
    h.add(make_request("t", r.all_token_ids[:8] + [1], max_tokens=1))
    scheduler_output = h.schedule()
    assert scheduler_output.scheduled_new_reqs[0].num_computed_tokens == 8
    h.run()


# ---------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_matches_sync(make: MakeHarness, depth: int, seed: int,
                                      stages: int) -> None:
    """Outputs under async scheduling equal sync scheduling's, with chunked prefill, grammars,
    stop tokens and preemption (asserted to happen) in the mix; with pipeline stages too
    (where the fake runner also checks that every new token reaches the workers)."""
    rng = random.Random(seed)
    specs = []
    special: dict[str, dict[int, int]] = {}
    for i in range(8):
        req_id = f"q{i}"
        max_tokens = rng.randint(1, 12)
        kwargs: dict = {"max_tokens": max_tokens}
        if i % 3 == 0:
            kwargs["grammar"] = " ".join(str(rng.randint(1, 500)) for _ in range(rng.randint(1, 5)))
        elif i % 3 == 1 and max_tokens > 2:
            special[req_id] = {rng.randint(0, max_tokens - 1): EOS}
        specs.append((req_id, rng.randint(1, 20), kwargs))
    runs = {}
    for async_scheduling in (False, True):
        h = make(async_scheduling=async_scheduling, depth=depth if async_scheduling else 1,
                 pipeline_parallel_size=stages if async_scheduling else 1,
                 policy=special_policy(special), num_blocks=14, block_size=4,
                 max_num_batched_tokens=16, max_num_seqs=6)
        h.add(*(make_request(r, p, **kw) for r, p, kw in specs))
        h.run()
        assert h.sched.num_preemptions > 0, "the workload must force preemption"
        runs[async_scheduling] = h
    assert runs[True].tokens == runs[False].tokens
    for r, _, _ in specs:
        assert runs[True].finish_reason(r) == runs[False].finish_reason(r)


def test_preemption_in_an_empty_step_reaches_the_runner(model_config: ModelConfig) -> None:
    """A step can schedule no tokens yet preempt a request (A has all its tokens in flight, B
    needs a block and preempts itself). That step never runs, so unschedule() must carry the
    preemption into the next step, or the runner keeps a stale row for B."""
    from tests.v1.core.sched_utils import make_config, make_kv
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    config = make_config(model_config, num_blocks=3, async_scheduling=True)
    scheduler = AsyncScheduler(config, make_kv(config))
    scheduler.add_request(make_request("a", 4, max_tokens=1))
    scheduler.add_request(make_request("b", 8, max_tokens=10))
    first = scheduler.schedule()
    assert first.sampled_req_ids == ["a", "b"]
    scheduler.sampling_issued(first)  # as the engine does right behind the forward
    empty = scheduler.schedule()  # step 1 still in flight
    assert empty.total_num_scheduled_tokens == 0
    assert empty.preempted_req_ids == {"b"}
    scheduler.unschedule(empty)
    assert scheduler.schedule().preempted_req_ids == {"b"}
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == 3


def test_request_waits_until_its_previous_step_is_sampled(model_config: ModelConfig) -> None:
    """The runner feeds a request's previous token from the device, so a request that
    samples in a step whose sample_tokens is not issued yet (a deferred step) is not
    scheduled; other requests are, and it runs again once the engine reports the sampling."""
    from tests.v1.core.sched_utils import make_config, make_kv
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    config = make_config(model_config, async_scheduling=True)
    scheduler = AsyncScheduler(config, make_kv(config))
    scheduler.add_request(make_request("a", 4, max_tokens=10))
    scheduler.add_request(make_request("b", 4, max_tokens=10))
    first = scheduler.schedule()
    scheduler.sampling_issued(first)
    second = scheduler.schedule()  # a and b again; its sampling is not issued
    assert second.sampled_req_ids == ["a", "b"]
    scheduler.add_request(make_request("c", 4, max_tokens=10))
    third = scheduler.schedule()
    assert list(third.num_scheduled_tokens) == ["c"]
    assert [scheduler.requests[r].num_output_placeholders for r in "abc"] == [2, 2, 1]
    assert scheduler.schedule().total_num_scheduled_tokens == 0  # everyone waits now
    scheduler.sampling_issued(second)
    fourth = scheduler.schedule()  # c still waits for the third step's sampling
    assert fourth.sampled_req_ids == ["a", "b"]
    scheduler.sampling_issued(third)
    scheduler.sampling_issued(fourth)
    assert scheduler.schedule().sampled_req_ids == ["a", "b", "c"]
    scheduler.finish_requests(["a", "b", "c"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


# ---------------------------------------------------------------------- reasoning
# With a reasoning parser a constraint applies only to the answer after `</think>`, from the
# very next token: in these tests a reasoning token reaching the fake grammar ends the
# request with an error, and a thinking step constrained by the grammar would sample the
# grammar's token (21) instead of the fake model's (1000 + k).

THINK, END_THINK, TURN = 151_667, 151_668, 151_644  # <think>, </think>, <|im_start|>
SEQ = [21, 22, 23]


def _reasoning(h: Harness, name: str = "qwen3") -> None:
    """Gives the harness's structured-output manager the parser `name` with Qwen's ids."""
    h.sched.structured_output_manager.reasoning_parser = ReasoningParser(
        name, PARSERS[name], THINK, END_THINK, frozenset({TURN}))


def _record_rows(h: Harness) -> list[tuple[int, dict[str, np.ndarray]]]:
    """Records, per sampled step, the bitmask row of each constrained request."""
    log: list[tuple[int, dict[str, np.ndarray]]] = []
    bitmask = h.sched.get_grammar_bitmask

    def recorded(scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        out = bitmask(scheduler_output)
        rows = {} if out is None else {
            r: out.grammar_bitmask[i].copy()
            for i, r in enumerate(out.structured_output_request_ids)}
        log.append((scheduler_output.step_id, rows))
        return out

    h.sched.get_grammar_bitmask = recorded  # type: ignore[method-assign]
    return log


def _allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


SCHEDULING = [
    pytest.param({"async_scheduling": False}, id="sync"),
    pytest.param({"depth": 2}, id="async2"),
    pytest.param({"depth": 3}, id="async3"),
]


@pytest.mark.parametrize("kwargs", SCHEDULING)
def test_grammar_starts_right_after_the_end_of_thinking(
    make: MakeHarness, kwargs: dict
) -> None:
    h = make(**kwargs)
    _reasoning(h)
    rows = _record_rows(h)
    h.runner.force.update({("g", 0): THINK, ("g", 4): END_THINK})
    h.add(make_request("g", 5, grammar=" ".join(map(str, SEQ))),
          make_request("p", 5, max_tokens=12))
    h.run()
    assert h.tokens["g"] == [THINK, 1001, 1002, 1003, END_THINK, *SEQ, GRAMMAR_END]
    assert h.finish_reason("g") == "stop"
    assert h.tokens["p"] == expected("p", 12)
    sampling_steps = [step.step_id for step in h.runner.steps if "g" in step.sampled_req_ids]
    rows_of_step = dict(rows)
    constrained = [k for k, step in enumerate(sampling_steps) if "g" in rows_of_step[step]]
    # Output 0 may open a thinking block (its row allows <think> and the grammar's first
    # token); outputs 1-4 are thinking (no row); from output 5 on the grammar constrains.
    assert constrained == [0, 5, 6, 7, 8]
    first_row = next(r["g"] for _, r in rows if "g" in r)
    assert _allowed(first_row) == {SEQ[0], THINK}


@pytest.mark.parametrize("kwargs", SCHEDULING)
@pytest.mark.parametrize("case", ["no_think", "deepseek", "closed_in_prompt", "new_turn",
                                  "never_closed"])
def test_reasoning_state_from_prompt_and_first_token(
    make: MakeHarness, kwargs: dict, case: str
) -> None:
    h = make(**kwargs)
    _reasoning(h, "deepseek_r1" if case in ("deepseek", "closed_in_prompt") else "qwen3")
    prompt = [3000, 3001, 3002]
    max_tokens = None
    if case == "deepseek":  # thinks from its first token, without writing <think>
        h.runner.force[("g", 2)] = END_THINK
        want = [1000, 1001, END_THINK, *SEQ, GRAMMAR_END]
    elif case == "closed_in_prompt":  # enable_thinking=False writes an empty block
        prompt += [THINK, 3003, END_THINK, 3004]
        want = [*SEQ, GRAMMAR_END]
    elif case == "new_turn":  # an earlier turn's closed block does not count
        prompt += [THINK, END_THINK, TURN, 3005]
        h.runner.force[("g", 0)] = THINK
        h.runner.force[("g", 1)] = END_THINK
        want = [THINK, END_THINK, *SEQ, GRAMMAR_END]
    elif case == "never_closed":  # a thinking budget (max_tokens) hit while thinking
        h.runner.force[("g", 0)] = THINK
        max_tokens = 5
        want = [THINK, 1001, 1002, 1003, 1004]
    else:  # qwen3 that does not think: constrained from its first token
        want = [*SEQ, GRAMMAR_END]
    h.add(make_request("g", prompt, grammar=" ".join(map(str, SEQ)), max_tokens=max_tokens))
    grammar = h.added["g"].structured_output_request.future.result()
    h.run()
    assert h.tokens["g"] == want
    assert h.finish_reason("g") == ("length" if case == "never_closed" else "stop")
    assert grammar.num_processed_tokens == (0 if case == "never_closed" else len(SEQ) + 1)


@pytest.mark.parametrize("kwargs", SCHEDULING[:2])
@pytest.mark.parametrize("enable_in_reasoning", [True, False])
def test_enable_in_reasoning_constrains_from_the_first_token(
    make: MakeHarness, kwargs: dict, enable_in_reasoning: bool
) -> None:
    """structured_outputs_config.enable_in_reasoning: the grammar applies from the first
    token even though deepseek_r1 says every reply starts thinking; without it, the reply
    thinks freely (the fake model's tokens) and never reaches the grammar."""
    h = make(**kwargs)
    _reasoning(h, "deepseek_r1")
    h.sched.config.structured_outputs_config.enable_in_reasoning = enable_in_reasoning
    h.add(make_request("g", [3000, 3001], grammar=" ".join(map(str, SEQ)), max_tokens=6))
    h.run()
    if enable_in_reasoning:
        assert h.tokens["g"] == [*SEQ, GRAMMAR_END] and h.finish_reason("g") == "stop"
    else:
        assert h.tokens["g"] == [1000 + k for k in range(6)]
        assert h.finish_reason("g") == "length"


@pytest.mark.parametrize("late", ["think", "end"])
def test_preempted_while_reasoning_token_in_flight(make: MakeHarness, late: str) -> None:
    """y is preempted with its output 1 in flight: <think>'s successor or the `</think>`
    itself. After resuming, the grammar starts exactly after `</think>`."""
    h = make(depth=2, num_blocks=4, block_size=4)
    _reasoning(h)
    h.runner.force.update({("y", 0): THINK, ("y", 1 if late == "end" else 2): END_THINK})
    _preempt_y(h, 1, grammar=" ".join(map(str, SEQ)), max_tokens=None)
    h.sched.finish_requests(["x"], ABORTED)
    h.run()
    assert len(_resumed_steps(h, "y")) == 1
    thinking = [THINK] if late == "end" else [THINK, 1001]
    assert h.tokens["y"] == [*thinking, END_THINK, *SEQ, GRAMMAR_END]
    assert h.finish_reason("y") == "stop"


@pytest.mark.parametrize("kwargs", SCHEDULING)
def test_abort_with_end_of_thinking_in_flight(make: MakeHarness, kwargs: dict) -> None:
    h = make(**kwargs)
    _reasoning(h)
    h.runner.force.update({("g", 0): THINK, ("g", 2): END_THINK})
    h.add(make_request("g", 5, grammar=" ".join(map(str, SEQ))),
          make_request("p", 5, max_tokens=8))
    while h.runner.num_sampled.get("g", 0) < 3:  # </think> sampled, maybe not yet seen
        h.step()
    h.sched.finish_requests(["g"], ABORTED)
    h.run()
    assert h.tokens.get("g", []) == [THINK, 1001, END_THINK][: len(h.tokens.get("g", []))]
    assert h.tokens["p"] == expected("p", 8)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("condition", ["plain", "preemption", "chunked"])
def test_drafts_match_sync_without_drafts(
    make: MakeHarness, depth: int, condition: str
) -> None:
    config = SPEC_CONDITIONS[condition]
    reference = make(async_scheduling=False, policy=cyclic, **config)
    reference.add(*spec_workload())
    reference.run()
    h = make(policy=cyclic, depth=depth, num_speculative_tokens=3, **config)
    h.add(*spec_workload())
    # Requests scheduled while a step of theirs was in flight, and those of them given
    # drafts then (drafted one step stale).
    overlapped: set[str] = set()
    stale: set[str] = set()
    # Requests whose in-flight drafts assumed a verification that turned out to reject one.
    doomed: set[str] = set()
    schedule = h.sched.schedule
    propose_batch = h.sched.drafter.proposer.propose_batch
    waiting: set[str] = set()
    on_rejected: set[str] = set()

    def recording_propose_batch(contexts):
        # No proposal for a request the step will not take.
        assert not waiting & set(contexts), waiting & set(contexts)
        for req_id in on_rejected & set(contexts):
            # Its drafts in flight followed a context that did not happen: it drafts from
            # its confirmed tokens, as if its step in flight keeps none of them.
            tokens, num_confirmed, _ = contexts[req_id]
            assert len(tokens) == num_confirmed, req_id
            doomed.add(req_id)
        return propose_batch(contexts)

    def recording_schedule():
        running = h.sched.running
        in_flight = {r.request_id for r in running if r.num_output_placeholders}
        waiting.clear()
        waiting.update(r.request_id for r in running if h.sched._waits_for_sampling(r))
        on_rejected.clear()
        on_rejected.update({r.request_id for r in running if r.num_output_placeholders
                            and r.spec_token_ids and not r.kept_all_drafts} - waiting)
        scheduler_output = schedule()
        overlapped.update(in_flight & set(scheduler_output.num_scheduled_tokens))
        stale.update(in_flight & set(scheduler_output.scheduled_spec_decode_tokens))
        return scheduler_output

    h.sched.schedule = recording_schedule
    h.sched.drafter.proposer.propose_batch = recording_propose_batch
    while h.step():
        # At most two steps of a drafting request in flight (see AsyncScheduler).
        assert all(h.in_flight_samples(r) <= 2 for r in h.added)
    assert h.tokens == reference.tokens
    assert h.sched.drafter.stats.num_accepted_tokens > 0
    # No drafting request waits for its tokens: each is scheduled while a step of its own is
    # in flight, with drafts that follow that step's assumed tokens (for "g", checked by its
    # grammar as it would stand after them).
    assert {"a", "x1", "x2", "g"} <= overlapped
    assert "g" in stale
    assert doomed  # the rule above was exercised
    assert {r: h.finish_reason(r) for r in h.tokens} == {
        r: reference.finish_reason(r) for r in reference.tokens
    }


@pytest.mark.parametrize("forced", [True, False])
def test_constrained_drafts_follow_the_grammar_past_the_tokens_in_flight(
    make: MakeHarness, forced: bool
) -> None:
    """A constrained request drafts while a step of its own is in flight, checked by its
    grammar as it would stand after that step's tokens (drafts kept, then the guess). The
    grammar allows one sequence, so every draft it lets through is right: all are kept, and
    none of the lookup's cycle where the grammar leaves it (7, 8)."""
    seq = [300, 301, 7, 300, 301, 302, 303, 300, 301, 302, 303, 300, 7, 8]
    h = make(policy=cyclic, depth=2, num_speculative_tokens=3)
    h.add(make_request("g", CYCLE * 3, max_tokens=20,
                       grammar=("!" if forced else "") + " ".join(map(str, seq))))
    # Draft lists given while drafts of "g" were in flight: drafted after them.
    stacked = 0
    schedule = h.sched.schedule

    def recording_schedule():
        nonlocal stacked
        request = h.sched.requests.get("g")
        on_drafts = (request is not None and request.num_output_placeholders > 0
                     and bool(request.spec_token_ids))
        scheduler_output = schedule()
        stacked += on_drafts and "g" in scheduler_output.scheduled_spec_decode_tokens
        return scheduler_output

    h.sched.schedule = recording_schedule
    h.run()
    assert h.tokens["g"] == [*seq, GRAMMAR_END]
    if forced:
        # The forced tokens after the in-flight drafts are drafted with certainty. (The
        # lookup guesses the cycle where this grammar leaves it, so its stale drafts come
        # only where no drafts were in flight.)
        assert stacked > 0
    assert h.sched.drafter.stats.num_accepted_tokens == h.sched.drafter.stats.num_draft_tokens > 0
