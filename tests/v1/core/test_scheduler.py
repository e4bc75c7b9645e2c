"""Tests for vllm/v1/core/sched/scheduler.py (synchronous scheduling) with fake model outputs."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgspec
import pytest

from tests.v1.core.sched_utils import (
    MakeHarness,
    CYCLE,
    SPEC_CONDITIONS,
    cyclic,
    spec_workload,
    EOS,
    GRAMMAR_END,
    default_policy,
    make_request,
)
from vllm.exceptions import ErrorKind, InvalidRequestError
from vllm.multimodal.inputs import ImageFeature
from vllm.v1.metrics.engine_stats import EngineCoreStats
from vllm.v1.request import RequestStatus


def expected(req_id: str, n: int) -> list[int]:
    """The first n tokens the default policy samples for req_id."""
    return [default_policy(req_id, k) for k in range(n)]


def test_budget_shared_by_decodes_and_chunked_prefill(make: MakeHarness) -> None:
    h = make(max_num_batched_tokens=8)
    h.add(make_request("a", 3, max_tokens=10), make_request("b", 3, max_tokens=10),
          make_request("c", 20, max_tokens=2))
    plan = [
        ({"a": 3, "b": 3, "c": 2}, ["a", "b"]),
        ({"a": 1, "b": 1, "c": 6}, ["a", "b"]),
        ({"a": 1, "b": 1, "c": 6}, ["a", "b"]),
        ({"a": 1, "b": 1, "c": 6}, ["a", "b", "c"]),  # c's prefill completes: 2+6+6+6 = 20
        ({"a": 1, "b": 1, "c": 1}, ["a", "b", "c"]),
    ]
    for num_scheduled, sampled in plan:
        scheduler_output = h.schedule()
        assert scheduler_output.num_scheduled_tokens == num_scheduled
        assert scheduler_output.total_num_scheduled_tokens == sum(num_scheduled.values()) <= 8
        assert sorted(scheduler_output.sampled_req_ids) == sampled
        h.update()
    assert h.finish_reason("c") == "length"
    h.run()
    assert h.tokens["a"] == expected("a", 10)
    assert h.tokens["c"] == expected("c", 2)
    assert h.scheduled["a"] == 3 + 10 - 1


def test_max_num_seqs_and_fcfs_admission(make: MakeHarness) -> None:
    h = make(max_num_seqs=2, max_num_batched_tokens=16)
    lengths = {"r0": 5, "r1": 2, "r2": 3, "r3": 1, "r4": 2}
    h.add(*(make_request(r, 4, max_tokens=n) for r, n in lengths.items()))
    first_step: dict[str, int] = {}
    running_sizes = []
    while h.step():
        running_sizes.append(len(h.sched.running))
        for r, steps in h.steps_of.items():
            first_step.setdefault(r, steps[0])
    assert max(running_sizes) == 2
    order = sorted(first_step, key=lambda r: (first_step[r], r))
    assert order == list(lengths), "admission is not first come, first served"
    # r1 finishes at step 2, so r2 starts at step 3; r2 (3 tokens) and r0 (5) end at steps 5.
    assert first_step == {"r0": 1, "r1": 1, "r2": 3, "r3": 6, "r4": 6}
    for r, n in lengths.items():
        assert h.tokens[r] == expected(r, n)
        assert h.finish_reason(r) == "length"


def test_fcfs_head_that_does_not_fit_is_not_overtaken(make: MakeHarness) -> None:
    h = make(num_blocks=7, max_num_batched_tokens=32)
    h.add(make_request("big", 16, max_tokens=1))  # 4 of the 7 blocks
    scheduler_output = h.schedule()
    assert scheduler_output.num_scheduled_tokens == {"big": 16}
    h.add(make_request("mid", 12, max_tokens=1), make_request("small", 4, max_tokens=1))
    h.update()  # "big" finishes: its blocks are free again
    h.add(make_request("big2", 16, max_tokens=2))
    scheduler_output = h.schedule()
    assert list(scheduler_output.num_scheduled_tokens) == ["mid", "small"]
    h.update()
    scheduler_output = h.schedule()
    # big2 needs 4 blocks; 7 are free again.
    assert list(scheduler_output.num_scheduled_tokens) == ["big2"]
    h.update()
    # Fill the pool so that the head cannot fit, then check that the tail waits behind it.
    h.add(make_request("huge", 20, max_tokens=1), make_request("tiny", 2, max_tokens=1))
    scheduler_output = h.schedule()
    # big2 decodes into its 5th block, leaving 2 free: huge needs 5, and tiny (1 block)
    # must wait behind it.
    assert list(scheduler_output.num_scheduled_tokens) == ["big2"]
    assert [r.request_id for r in h.sched.waiting] == ["huge", "tiny"]
    h.update()
    h.run()
    assert h.steps_of["huge"][0] <= h.steps_of["tiny"][0]


def test_chunked_prefill_of_long_prompt(make: MakeHarness) -> None:
    h = make(max_num_batched_tokens=8, block_size=4)
    prompt = list(range(200, 220))
    h.add(make_request("long", prompt, max_tokens=3))
    scheduler_output = h.schedule()
    assert [n.req_id for n in scheduler_output.scheduled_new_reqs] == ["long"]
    new = scheduler_output.scheduled_new_reqs[0]
    assert new.prompt_token_ids == prompt and new.num_computed_tokens == 0
    assert len(new.block_ids) == 2
    assert scheduler_output.num_scheduled_tokens == {"long": 8} and scheduler_output.sampled_req_ids == []
    out = h.update()
    assert out == [], "a partial prefill must not produce output"
    for computed, n, new_blocks, sampled in ((8, 8, 2, False), (16, 4, 1, True)):
        scheduler_output = h.schedule()
        cached = scheduler_output.scheduled_cached_reqs
        assert cached.req_ids == ["long"] and cached.resumed_from_preemption == [False]
        assert cached.num_computed_tokens == [computed]
        assert len(cached.new_block_ids[0]) == new_blocks
        assert scheduler_output.num_scheduled_tokens == {"long": n}
        assert scheduler_output.sampled_req_ids == (["long"] if sampled else [])
        h.update()
    h.run()
    assert h.tokens["long"] == expected("long", 3)
    assert h.scheduled["long"] == 20 + 3 - 1


def test_preemption_by_recompute(make: MakeHarness) -> None:
    h = make(num_blocks=6, block_size=4, max_num_batched_tokens=32)
    h.add(make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8))
    h.step()
    # Arrives after b and needs 3 blocks, more than are ever free while a and b run.
    h.add(make_request("c", 9, max_tokens=2))
    preempt_so = None
    while h.step():
        scheduler_output = h.runner.steps[-1]
        if scheduler_output.preempted_req_ids and preempt_so is None:
            preempt_so = scheduler_output
            assert scheduler_output.preempted_req_ids == {"b"}, "the latest running request is the victim"
            assert "b" not in scheduler_output.num_scheduled_tokens and "a" in scheduler_output.num_scheduled_tokens
            assert [r.request_id for r in h.sched.waiting][:2] == ["b", "c"]
            assert h.kv.get_block_ids("b") == []
            b_outputs_at_preemption = list(h.added["b"].output_token_ids)
    assert preempt_so is not None, "no preemption happened"
    assert h.added["b"].num_preemptions >= 1
    assert h.sched.make_stats().num_preemptions == h.sched.num_preemptions >= 1
    resumed = [
        (scheduler_output, i) for scheduler_output in h.runner.steps
        for i, r in enumerate(scheduler_output.scheduled_cached_reqs.req_ids)
        if r == "b" and scheduler_output.scheduled_cached_reqs.resumed_from_preemption[i]
    ]
    assert resumed, "b never resumed"
    scheduler_output, i = resumed[0]
    cached = scheduler_output.scheduled_cached_reqs
    b = h.added["b"]
    token_ids = cached.resumed_req_token_ids["b"]
    assert token_ids == b.prompt_token_ids + b_outputs_at_preemption
    assert cached.resumed_num_output_tokens["b"] == len(b_outputs_at_preemption)
    assert cached.num_computed_tokens[i] % 4 == 0
    # Recompute everything that is not a prefix-cache hit, then sample the next token.
    assert scheduler_output.num_scheduled_tokens["b"] == len(token_ids) - cached.num_computed_tokens[i]
    assert "b" in scheduler_output.sampled_req_ids
    assert len(cached.new_block_ids[i]) == -(-len(token_ids) // 4)
    assert h.steps_of["c"][0] >= scheduler_output.step_id, "c overtook the preempted b"
    for r, n in (("a", 8), ("b", 8), ("c", 2)):
        assert h.tokens[r] == expected(r, n)
        assert h.finish_reason(r) == "length"


def _policy_with(special: dict[int, int], who: str = "r") -> Callable[[str, int], int]:
    """The default policy, except output k of request `who` is special[k] where given."""
    return lambda req_id, k: (
        special[k] if req_id == who and k in special else default_policy(req_id, k)
    )


@pytest.mark.parametrize(
    "params, special, max_model_len, want_tokens, reason, stop_reason",
    [
        pytest.param({"max_tokens": 10}, {2: EOS}, 64, 3, "stop", None, id="eos"),
        pytest.param({"max_tokens": 10, "stop_token_ids": [777]}, {1: 777}, 64, 2, "stop", 777,
                     id="stop_token_id"),
        pytest.param({"max_tokens": 3}, {}, 64, 3, "length", None, id="max_tokens"),
        pytest.param({"max_tokens": 10, "min_tokens": 3}, {1: EOS, 4: EOS}, 64, 5, "stop", None,
                     id="eos_before_min_tokens"),
        pytest.param({"max_tokens": 10, "min_tokens": 3}, {2: EOS}, 64, 3, "stop", None,
                     id="eos_at_min_tokens"),
        pytest.param({"max_tokens": 10, "ignore_eos": True}, {1: EOS}, 64, 10, "length", None,
                     id="ignore_eos"),
        pytest.param({"max_tokens": None}, {}, 12, 12 - 8, "length", None, id="max_model_len"),
    ],
)
def test_stop_checks(
    make: MakeHarness, params: dict, special: dict[int, int], max_model_len: int,
    want_tokens: int, reason: str, stop_reason: int | None,
) -> None:
    h = make(max_model_len=max_model_len, policy=_policy_with(special))
    h.add(make_request("r", 8, **params), make_request("other", 8, max_tokens=12))
    h.run()
    policy = _policy_with(special)
    assert h.tokens["r"] == [policy("r", k) for k in range(want_tokens)]
    assert h.finish_reason("r") == reason
    assert h.outputs["r"][-1].stop_reason == stop_reason
    assert all(not o.finished for o in h.outputs["r"][:-1])
    assert h.scheduled["r"] == 8 + want_tokens - 1
    assert h.scheduled["r"] <= max_model_len - 1


def test_abort_waiting_and_running_frees_blocks(make: MakeHarness) -> None:
    h = make(max_num_seqs=2, num_blocks=16)
    h.add(*(make_request(r, 6, max_tokens=6) for r in ("a", "b", "c")))
    h.step()
    assert h.kv.get_block_ids("b") and h.kv.num_free_blocks < 16
    free_before = h.kv.num_free_blocks
    num_b = len(h.kv.get_block_ids("b"))
    h.sched.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)  # running, waiting
    h.sched.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED)  # ignored
    assert h.kv.num_free_blocks == free_before + num_b
    assert h.added["b"].status == h.added["c"].status == RequestStatus.FINISHED_ABORTED
    scheduler_output = h.schedule()
    assert scheduler_output.finished_req_ids == {"b", "c"}
    assert set(scheduler_output.num_scheduled_tokens) == {"a"}
    h.update()
    h.run()
    assert h.tokens["a"] == expected("a", 6)
    assert "c" not in h.tokens and h.tokens["b"] == expected("b", 1)


def test_make_stats_reports_requests_blocks_and_counters(make: MakeHarness) -> None:
    h = make(max_num_seqs=2, num_blocks=16, block_size=4)
    idle = h.sched.make_stats()
    assert isinstance(idle, EngineCoreStats)
    assert (idle.num_running, idle.num_waiting, idle.num_aborted_requests) == (0, 0, 0)
    assert idle.kv.num_free_blocks == idle.kv.num_blocks == 16 and idle.kv.usage == 0.0
    h.add(*(make_request(r, 6, max_tokens=6) for r in ("a", "b", "c")))
    h.step()
    busy = h.sched.make_stats()
    assert (busy.num_running, busy.num_waiting) == (2, 1)
    assert busy.kv.num_free_blocks == h.kv.num_free_blocks < 16
    assert busy.kv.usage == pytest.approx(1 - busy.kv.num_free_blocks / 16)
    prefix = h.kv.prefix_cache_stats
    assert (busy.kv.prefix_cache_queries, busy.kv.prefix_cache_hits) == (prefix.queries, prefix.hits)
    assert busy.kv.prefix_cache_queries > 0
    assert busy.timestamp >= idle.timestamp
    # The scheduler's own record crosses the process boundary unchanged.
    wire = msgspec.msgpack.Encoder().encode(busy)
    assert msgspec.msgpack.Decoder(EngineCoreStats).decode(wire) == busy
    # Only aborts that find the request alive count: b and c, not b again nor "nope".
    h.sched.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)
    h.sched.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED)
    assert h.sched.make_stats().num_aborted_requests == 2
    h.run()
    done = h.sched.make_stats()
    assert (done.num_running, done.num_waiting, done.num_aborted_requests) == (0, 0, 2)
    assert done.kv.num_free_blocks == done.kv.num_blocks and done.kv.usage == 0.0
    assert not done.same_as(idle)  # the cumulative counters moved


def test_abort_preempted_request(make: MakeHarness) -> None:
    h = make(num_blocks=6, block_size=4, max_num_batched_tokens=32)
    h.add(make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8))
    while not h.sched.num_preemptions:
        assert h.step()
    assert h.added["b"].status == RequestStatus.PREEMPTED
    h.sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    h.run()
    assert h.tokens["a"] == expected("a", 8)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_prefix_cache_hit_in_new_request_data(make: MakeHarness, enable_caching: bool) -> None:
    h = make(block_size=4, enable_prefix_caching=enable_caching)
    prompt = list(range(300, 310))
    h.add(make_request("first", prompt, max_tokens=2))
    scheduler_output = h.schedule()
    first_blocks = scheduler_output.scheduled_new_reqs[0].block_ids
    h.run()
    h.add(make_request("second", prompt[:8] + [1, 2, 3], max_tokens=2),
          make_request("whole", prompt[:8], max_tokens=1))
    scheduler_output = h.schedule()
    new = {n.req_id: n for n in scheduler_output.scheduled_new_reqs}
    if enable_caching:
        assert new["second"].num_computed_tokens == 8
        assert new["second"].block_ids[:2] == first_blocks[:2]
        assert scheduler_output.num_scheduled_tokens["second"] == 3
        # A fully cached prompt still computes its last block's tokens to sample from.
        assert new["whole"].num_computed_tokens == 4
        assert scheduler_output.num_scheduled_tokens["whole"] == 4
        assert new["whole"].block_ids[0] == first_blocks[0]
    else:
        assert new["second"].num_computed_tokens == new["whole"].num_computed_tokens == 0
        assert scheduler_output.num_scheduled_tokens == {"second": 11, "whole": 8}
    h.update()
    assert h.outputs["second"][0].num_cached_tokens == (8 if enable_caching else 0)
    h.run()


def test_structured_request_follows_its_grammar(make: MakeHarness) -> None:
    h = make()
    h.add(make_request("g", 5, max_tokens=10, grammar="5 6 7"),
          make_request("bad", 5, max_tokens=10, grammar="fail"),
          make_request("plain", 5, max_tokens=4))
    h.run()
    assert h.tokens["g"] == [5, 6, 7, GRAMMAR_END] and h.finish_reason("g") == "stop"
    assert h.finish_reason("bad") == "error" and h.outputs["bad"][-1].error
    # A grammar that does not compile is the client's fault, whatever its message says.
    assert h.outputs["bad"][-1].error_kind is ErrorKind.GRAMMAR
    assert h.tokens.get("bad", []) == []
    assert h.tokens["plain"] == expected("plain", 4)


def test_grammar_that_cannot_advance_ends_only_its_request(make: MakeHarness) -> None:
    h = make()
    h.add(make_request("g1", 5, max_tokens=10, grammar="5 6 7"),
          make_request("g2", 5, max_tokens=10, grammar="5 6 7"),
          make_request("plain", 5, max_tokens=5))
    h.runner.force[("g1", 1)] = 9  # the grammar wants 6
    h.run()
    assert h.finish_reason("g1") == "error" and h.outputs["g1"][-1].error
    # A sampled token the grammar rejects is an engine bug (the bitmask should exclude it).
    assert h.outputs["g1"][-1].error_kind is ErrorKind.INTERNAL
    assert h.tokens["g1"] == [5]
    assert h.tokens["g2"] == [5, 6, 7, GRAMMAR_END] and h.finish_reason("g2") == "stop"
    assert h.tokens["plain"] == expected("plain", 5)


def test_duplicate_request_id_is_refused(make: MakeHarness) -> None:
    h = make()
    h.add(make_request("a", 5, max_tokens=3))
    h.schedule()
    with pytest.raises(InvalidRequestError, match="already in use") as info:
        h.sched.add_request(make_request("a", 7, max_tokens=3))
    assert info.value.param == "request_id"
    h.check()  # the live request is untouched and nothing else got registered
    h.run()
    assert h.tokens["a"] == expected("a", 3)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_finish_with_error_frees_whatever_the_request_holds(
    make: MakeHarness, async_scheduling: bool
) -> None:
    h = make(async_scheduling=async_scheduling, max_num_seqs=2)
    h.add(
        make_request("running", 5, max_tokens=10),
        make_request("plain", 5, max_tokens=4),
        make_request("waiting", 5, max_tokens=4),
        make_request("grammar", 5, max_tokens=4, grammar="5 6 7"),
    )
    h.schedule()  # "running" and "plain" are admitted; their step is in flight
    sched = h.sched
    for req_id in ("running", "waiting", "grammar", "never-admitted"):
        sched.finish_with_error(req_id, f"bad {req_id}", ErrorKind.INVALID_REQUEST)
    h.check()
    errors = {out.request_id: out for out in sched.take_pending_outputs()}
    assert set(errors) == {"running", "waiting", "grammar", "never-admitted"}
    for req_id, out in errors.items():
        assert out.finish_reason == "error" and out.error == f"bad {req_id}"
        assert out.error_kind is ErrorKind.INVALID_REQUEST
        assert out.new_token_ids == []
    assert set(sched.requests) == {"plain"}
    h.run()  # the in-flight token of "running" is dropped when it lands
    assert "running" not in h.tokens
    assert h.tokens["plain"] == expected("plain", 4)


def test_failed_grammar_start_registers_nothing(
    make: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make()
    som = h.sched.structured_output_manager
    assert som is not None
    grammar_init = som.grammar_init

    def failing_grammar_init(request) -> None:
        grammar_init(request)  # registered with the manager, then the start fails
        raise RuntimeError("compile pool is gone")

    monkeypatch.setattr(som, "grammar_init", failing_grammar_init)
    with pytest.raises(RuntimeError, match="compile pool"):
        h.sched.add_request(make_request("g", 5, max_tokens=4, grammar="5 6"))
    assert "g" not in h.sched.requests and not h.sched.waiting
    assert som.num_live_grammars == 0


# ---------------------------------------------------------------------- pipeline stages


def test_pipeline_stages_split_requests_between_in_flight_steps(make: MakeHarness) -> None:
    """With two stages the first step takes half the requests, and the second (scheduled
    while the first is in flight) the other half; no request is ever in two in-flight steps."""
    h = make(pipeline_parallel_size=2, depth=2)
    h.add(*(make_request(f"r{i}", 3, max_tokens=4) for i in range(4)))
    first = h.schedule()
    second = h.schedule()
    assert sorted(first.num_scheduled_tokens) == ["r0", "r1"]
    assert sorted(second.num_scheduled_tokens) == ["r2", "r3"]
    while h.step():
        in_flight = [set(e.scheduler_output.num_scheduled_tokens) for e in h.in_flight]
        assert all(not (a & b) for i, a in enumerate(in_flight) for b in in_flight[i + 1:])
    for i in range(4):
        assert h.tokens[f"r{i}"] == expected(f"r{i}", 4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pipeline_stages_give_the_workers_every_new_token(
    make: MakeHarness, async_scheduling: bool
) -> None:
    """Under pipeline parallelism the workers learn each sampled token from the next step's
    new_token_ids (the fake runner checks every one), with preemption and chunked prefill
    in the mix; outputs equal one stage's."""
    runs = {}
    for stages in (1, 2):
        h = make(pipeline_parallel_size=stages, depth=stages, async_scheduling=async_scheduling,
                 num_blocks=10, block_size=4, max_num_batched_tokens=12, max_num_seqs=6)
        h.add(*(make_request(f"q{i}", 3 + 4 * i, max_tokens=6 + i) for i in range(6)))
        h.run()
        runs[stages] = h
    assert runs[2].sched.num_preemptions > 0, "the workload must force preemption"
    assert any(s.scheduled_cached_reqs.new_token_ids for s in runs[2].runner.steps)
    assert runs[2].tokens == runs[1].tokens


# ---------------------------------------------------------------------- speculative decoding

@pytest.mark.parametrize("condition", ["plain", "preemption", "chunked"])
def test_drafts_change_no_token_and_save_steps(make: MakeHarness, condition: str) -> None:
    config = SPEC_CONDITIONS[condition]
    runs = {}
    # (request, outputs known when scheduled, drafts) for every drafted request of a step.
    drafted: list[tuple[object, int, list[int]]] = []
    for k in (0, 3):
        h = make(policy=cyclic, num_speculative_tokens=k, **config)
        schedule = h.sched.schedule

        def recording_schedule(h=h, schedule=schedule):
            out = schedule()
            for req_id, drafts in out.scheduled_spec_decode_tokens.items():
                drafted.append((h.added[req_id], h.added[req_id].num_output_tokens, drafts))
            return out

        h.sched.schedule = recording_schedule
        h.add(*spec_workload())
        h.run()
        runs[k] = h
    plain, spec = runs[0], runs[3]
    assert spec.tokens == plain.tokens
    assert {r: spec.finish_reason(r) for r in spec.tokens} == {
        r: plain.finish_reason(r) for r in plain.tokens
    }
    assert len(spec.tokens["x1"]) == 17 and spec.tokens["g"][:8] == [
        300, 301, 302, 303, 300, 301, 7, 8]
    assert len(spec.runner.steps) < len(plain.runner.steps)
    sched = spec.sched
    assert sched.drafter.stats.num_draft_tokens > sched.drafter.stats.num_accepted_tokens > 0  # "x" requests reject some
    if condition == "preemption":
        assert sched.num_preemptions > 0
    assert drafted
    for request, done, drafts in drafted:
        assert 1 <= len(drafts) <= 3
        # Never past max_tokens: the drafts and the token after them fit.
        assert done + len(drafts) + 1 <= request.sampling_params.max_tokens
    stats = sched.make_stats()
    assert (stats.spec.num_draft_tokens, stats.spec.num_accepted_tokens) == (
        sched.drafter.stats.num_draft_tokens, sched.drafter.stats.num_accepted_tokens)


def test_grammar_cuts_drafts_at_the_first_rejected_token(make: MakeHarness) -> None:
    h = make(policy=cyclic, num_speculative_tokens=4)
    # After "300 301" the lookup drafts 302 303 300 301; the grammar allows only 7 (or a
    # stop) next.
    h.add(make_request("g", CYCLE * 3, max_tokens=12, grammar="?300 301 7 300"))
    h.run()
    assert h.tokens["g"] == [300, 301, 7, 300, GRAMMAR_END]
    drafts = [s.scheduled_spec_decode_tokens.get("g") for s in h.runner.steps]
    # Step 2 (after 300) drafts 301 only: the grammar rejects the 302 the lookup proposed.
    assert drafts[1] == [301]
    for d in drafts:
        assert d is None or 302 not in d


def test_forced_tokens_are_drafted_before_the_lookup(make: MakeHarness) -> None:
    h = make(policy=cyclic, num_speculative_tokens=4)
    h.add(make_request("g", CYCLE * 3, max_tokens=12, grammar="!300 301 7 300 301 302 303"))
    h.run()
    assert h.tokens["g"] == [300, 301, 7, 300, 301, 302, 303, GRAMMAR_END]
    drafts = [s.scheduled_spec_decode_tokens.get("g") for s in h.runner.steps]
    # After the first token the grammar forces the next four (the lookup would say 301 302).
    assert drafts[1] == [301, 7, 300, 301]
    # All four kept, plus 302: forced 303, then the lookup's guess (300), which the grammar
    # refuses (it wants the end).
    assert drafts[2] == [303]
    assert len(h.runner.steps) == 3  # prefill, then two verifications (the last ends it)


def test_no_drafts_for_penalties_logprobs_or_min_tokens(make: MakeHarness) -> None:
    h = make(policy=cyclic, num_speculative_tokens=3)
    h.add(make_request("pen", CYCLE * 3, max_tokens=6, presence_penalty=0.5),
          make_request("lp", CYCLE * 3, max_tokens=6, logprobs=2),
          make_request("min", CYCLE * 3, max_tokens=6, min_tokens=4),
          make_request("free", CYCLE * 3, max_tokens=6))
    h.run()
    drafted = {r for s in h.runner.steps for r in s.scheduled_spec_decode_tokens}
    assert drafted == {"min", "free"}
    # min_tokens: drafting starts once the minimum is reached.
    first = next(i for i, s in enumerate(h.runner.steps)
                 if "min" in s.scheduled_spec_decode_tokens)
    assert sum("min" in s.sampled_req_ids for s in h.runner.steps[:first]) >= 4
    assert all(h.tokens[r] == [cyclic(r, k) for k in range(6)] for r in h.tokens)


def test_drafts_take_only_blocks_no_regular_token_needs(make: MakeHarness) -> None:
    """Five blocks of four tokens. After the prefills one block is free: b's next token
    needs it, so a (whose next token fits its blocks) gets no drafts instead of b being
    preempted. The steps are those of the run without drafts."""
    runs = {}
    for k in (0, 3):
        h = make(policy=cyclic, num_speculative_tokens=k, block_size=4, num_blocks=5)
        h.add(make_request("a", [5, 6, 5, 6, 5, 6, 5], max_tokens=3),
              make_request("b", [9, 8, 7, 6, 5, 4, 3, 2], max_tokens=3))
        h.run()
        runs[k] = h
    assert runs[3].tokens == runs[0].tokens
    second = runs[3].runner.steps[1]
    assert second.num_scheduled_tokens == {"a": 1, "b": 1} and not second.preempted_req_ids
    assert [s.num_scheduled_tokens for s in runs[3].runner.steps] == [
        s.num_scheduled_tokens for s in runs[0].runner.steps]
    assert runs[3].sched.num_preemptions == runs[0].sched.num_preemptions


def test_blocks_of_rejected_drafts_are_freed(make: MakeHarness) -> None:
    # "x1" breaks its cycle every fifth token, so some drafts are rejected; blocks of 2
    # tokens make the drafts reach blocks of their own.
    h = make(policy=cyclic, num_speculative_tokens=3, block_size=2, num_blocks=64)
    h.add(make_request("x1", CYCLE * 3, max_tokens=17, ignore_eos=True))
    trimmed = []
    update = h.sched.update_from_output

    def recording_update(scheduler_output, output):
        outs = update(scheduler_output, output)
        request = h.sched.requests.get("x1")
        if request is not None:
            # Never more blocks than the computed tokens need.
            owned = len(h.kv.get_block_ids("x1"))
            assert owned <= -(-request.num_computed_tokens // 2), owned
            trimmed.append(h.sched._kept_blocks.get("x1"))
        return outs

    h.sched.update_from_output = recording_update
    h.run()
    assert len(h.tokens["x1"]) == 17
    assert any(n is not None for n in trimmed)
    # The runner was told: its block counts followed (FakeRunner checks every step).
    assert any("x1" in s.num_kept_blocks for s in h.runner.steps)


def test_first_output_after_the_first_schedule_carries_its_time(make: MakeHarness) -> None:
    """The queue-time metrics need when a request was first scheduled: its first output
    carries that time (a chunked prefill's outputs come later), no later output does, and a
    request that fails after it was scheduled still reports it."""
    h = make(max_num_batched_tokens=8)
    h.add(make_request("doomed", 2, max_tokens=50), make_request("long", 20, max_tokens=3))
    h.step()
    assert h.added["doomed"].first_scheduled_time is not None
    h.sched.finish_with_error("doomed", "boom", ErrorKind.INTERNAL)
    h.run()
    first = h.outputs["long"][0].first_scheduled_time
    assert first is not None and first == h.added["long"].first_scheduled_time
    assert all(out.first_scheduled_time is None for out in h.outputs["long"][1:])
    errored = [out for out in h.outputs["doomed"] if out.error == "boom"]
    assert [out.first_scheduled_time for out in h.outputs["doomed"]].count(None) == (
        len(h.outputs["doomed"]) - 1)
    assert errored and errored[-1].error_kind == ErrorKind.INTERNAL


def _image(offset: int, length: int) -> ImageFeature:
    return ImageFeature(offset=offset, length=length, grid_thw=(1, 2, 2 * length),
                        pixel_bytes=b"", patch_dim=1,
                        content_hash=hashlib.sha256(f"{offset}-{length}".encode()).hexdigest())


def test_a_step_encodes_at_most_its_token_budget_of_images(make: MakeHarness) -> None:
    """A step encodes images of at most max_num_batched_tokens placeholder tokens: a
    request's tokens stop before an image that does not fit, a running request inside an
    image it began costs nothing, a request that cannot start stops admission, and one
    image larger than the budget still gets a step without other images."""
    h = make(max_num_batched_tokens=32)
    h.add(make_request("a", 24, max_tokens=2, mm_features=[_image(2, 20)]),
          make_request("b", 24, max_tokens=2, mm_features=[_image(2, 20)]),
          make_request("c", 4, max_tokens=2))
    # a encodes its 20; b's image would make 40: b computes only the 2 tokens before it.
    assert h.schedule().num_scheduled_tokens == {"a": 24, "b": 2, "c": 4}
    h.update()
    assert h.schedule().num_scheduled_tokens == {"a": 1, "b": 22, "c": 1}
    h.update()
    h.run()
    h.add(make_request("d", 44, max_tokens=1, mm_features=[_image(0, 40)]),
          make_request("e", 8, max_tokens=1, mm_features=[_image(1, 4)]),
          make_request("f", 3, max_tokens=1))
    # d's 40 exceed the budget but go alone; e cannot start, and f waits behind it.
    assert h.schedule().num_scheduled_tokens == {"d": 32}
    h.update()
    # d is inside the image it began: e's image fits beside it.
    assert h.schedule().num_scheduled_tokens == {"d": 12, "e": 8, "f": 3}
    h.update()
    h.run()
