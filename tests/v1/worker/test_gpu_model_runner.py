"""Model-runner behaviour that only shows when device-to-host copies lag (as on CUDA)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.v1.worker import gpu_model_runner, sampled_tokens


def _workload():
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    prompts = [" ".join(rng.choices(words, k=rng.randint(2, 40))) for _ in range(24)]
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


def _run(async_scheduling: bool, params: list[SamplingParams] | None = None, **kwargs):
    prompts, seeded = _workload()
    params = params or seeded
    llm = LLM("demo-tiny", max_model_len=128, max_num_seqs=16,
              async_scheduling=async_scheduling, **kwargs)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine.engine_core.scheduler
    finally:
        llm.shutdown()


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_lagging_copies_with_preemption_match_sync(monkeypatch, spec) -> None:
    """A request preempted with a token in flight resumes holding that token; when the copy
    lands later, the runner must not append it a second time, nor count the tokens a
    verification kept twice (seeded sampling reads the count)."""
    want, _ = _run(False)
    newest: list[object] = [None]
    original_init = sampled_tokens.SampledTokens.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        newest[0] = self

    monkeypatch.setattr(sampled_tokens.SampledTokens, "__init__", init)
    # The newest copy never counts as landed at non-blocking settles, as on a busy GPU.
    monkeypatch.setattr(sampled_tokens.SampledTokens, "ready", lambda self: self is not newest[0])
    for num_blocks in (56, 64):
        got, scheduler = _run(True, block_size=4, num_gpu_blocks_override=num_blocks,
                              enable_prefix_caching=False, speculative_config=spec)
        assert scheduler.num_preemptions > 0
        assert got == want, num_blocks


def _penalized_outputs(async_scheduling: bool) -> list:
    prompts, _ = _workload()
    params = [SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2,
                             repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.4,
                             **({"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0}))
              for i in range(len(prompts))]
    llm = LLM("demo-tiny", max_model_len=128, max_num_seqs=16,
              async_scheduling=async_scheduling)
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def _copies_never_land(monkeypatch) -> list[bool]:
    """Makes no device-to-host copy count as landed on its own (as on a busy GPU); returns
    the `block` argument of every settle the runner makes from then on."""
    monkeypatch.setattr(sampled_tokens.SampledTokens, "ready", lambda self: False)
    settle = gpu_model_runner.GPUModelRunner._settle
    blocking: list[bool] = []

    def spy(self, block: bool) -> None:
        blocking.append(block)
        settle(self, block)

    monkeypatch.setattr(gpu_model_runner.GPUModelRunner, "_settle", spy)
    return blocking


def test_penalties_count_tokens_still_on_the_device_without_waiting(monkeypatch) -> None:
    """With no host copy ever landing on its own, penalties must count the in-flight tokens
    from the device and never wait for a copy; tokens and logprobs equal the sync engine's."""
    want = _penalized_outputs(False)
    blocking = _copies_never_land(monkeypatch)
    got = _penalized_outputs(True)
    assert blocking and not any(blocking), "a step waited for a device-to-host copy"
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_bad_words_read_tokens_still_on_the_device_without_waiting(monkeypatch) -> None:
    """A bad word of two tokens is banned only right after its first token; with no host copy
    ever landing on its own, that token is read on the device, never waited for; tokens
    equal the sync engine's (and the ban changed them)."""
    from vllm.model_executor.model_loader.demos import resolve_model_dir
    from vllm.transformers_utils.tokenizer import get_tokenizer

    prompts, _ = _workload()
    free, _ = _run(False, [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)]
                   * len(prompts))
    # Ban what the greedy rows write first: its second token right after its first.
    tokenizer = get_tokenizer(resolve_model_dir("demo-tiny"))
    words = sorted({tokenizer.decode(list(ids[:2])) for ids in free[::2]})
    params = [SamplingParams(max_tokens=12, ignore_eos=True, bad_words=words,
                             **({"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0}))
              for i in range(len(prompts))]
    want, _ = _run(False, params)
    assert any(a != b for a, b in zip(want[::2], free[::2]))
    blocking = _copies_never_land(monkeypatch)
    got, _ = _run(True, params)
    assert blocking and not any(blocking), "a step waited for a device-to-host copy"
    assert got == want


def _mixed_outputs(async_scheduling: bool, **kwargs) -> tuple[list, object]:
    # Greedy rows keep most drafts, seeded random ones fewer: drafts are kept and rejected,
    # and seeds read output positions that count kept drafts.
    params = [SamplingParams(max_tokens=20, ignore_eos=True,
                             **({"temperature": 1.0, "top_k": 2, "seed": i} if i % 2
                                else {"temperature": 0}))
              for i in range(len(_workload()[0]))]
    return _run(async_scheduling, params, **kwargs)


def _stage_copies(monkeypatch) -> None:
    """Staging as on CUDA: the staged tensors are copies, so the host arrays keep the
    scheduler's counts and a backend that reads host lengths must be given the placed ones."""
    from vllm.v1.worker import input_buffers

    init = input_buffers.InputBuffers.__init__

    def copying_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.on_cpu = False

    monkeypatch.setattr(input_buffers.InputBuffers, "__init__", copying_init)
    monkeypatch.setattr(input_buffers.InputBuffers, "stage", lambda self, arrays: {
        name: torch.from_numpy(array.copy()) for name, array in arrays.items()})
    monkeypatch.setattr(input_buffers.InputBuffers, "to_device", lambda self, array: (
        torch.from_numpy(np.ascontiguousarray(array).copy())))


@pytest.mark.parametrize("staging", ["host arrays", "copies"])
def test_the_forward_after_a_verification_does_not_wait_for_its_kept_count(
    monkeypatch, staging: str
) -> None:
    """With no host copy ever landing on its own, a request verified with drafts must start
    its next forward right after the tokens it kept without waiting for the copy that says
    how many (positions, KV slots and lengths placed on the device); tokens equal the sync
    engine's without drafts, whether staged tensors share the host arrays (CPU) or are
    copies of them (CUDA)."""
    want, _ = _mixed_outputs(False)
    if staging == "copies":
        _stage_copies(monkeypatch)
    monkeypatch.setattr(sampled_tokens.SampledTokens, "ready", lambda self: False)
    runner_cls = gpu_model_runner.GPUModelRunner
    execute, settle = runner_cls.execute_model, runner_cls._settle
    inside = [False]
    waits_in_forward: list[bool] = []

    def execute_spy(self, scheduler_output):
        inside[0] = True
        try:
            return execute(self, scheduler_output)
        finally:
            inside[0] = False

    def settle_spy(self, block: bool) -> None:
        if inside[0]:
            waits_in_forward.append(block)
        settle(self, block)

    monkeypatch.setattr(runner_cls, "execute_model", execute_spy)
    monkeypatch.setattr(runner_cls, "_settle", settle_spy)
    got, scheduler = _mixed_outputs(
        True, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert 0 < scheduler.drafter.stats.num_accepted_tokens < scheduler.drafter.stats.num_draft_tokens
    assert waits_in_forward and not any(waits_in_forward), "a forward waited for a copy"
    assert got == want


# ---------------------------------------------------------------------- unsampled steps FIFO


def _runner_and_scheduler():
    """A CPU GPUModelRunner on demo-tiny and an AsyncScheduler over the same config."""
    from tests.v1.core.sched_utils import demo_model_config, make_config, make_kv
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    config = make_config(demo_model_config(), async_scheduling=True, num_blocks=32)
    runner = GPUModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(32)
    return config, runner, AsyncScheduler(config, make_kv(config))


def _seeded(req_id: str, seed: int):
    from tests.v1.core.sched_utils import EOS_IDS
    from vllm.v1.request import Request

    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True,
                            logprobs=2)
    params.update_from_model(EOS_IDS)
    return Request(req_id, [100 + seed * 7 + i for i in range(5 + seed)], params)


def test_on_forward_start_runs_once_per_forward_with_its_inputs_staged() -> None:
    """The uni executor hands the previous step's samples to the engine thread from this
    hook, so it must run once per step that has a forward: after the step's inputs are on
    the device (the previous samples fed in) and before the model runs; a step with nothing
    scheduled has no forward and no call."""
    from vllm.v1.request import RequestStatus

    _, runner, scheduler = _runner_and_scheduler()
    events: list[str] = []
    stage, forward = runner._stage, runner.model.forward
    runner._stage = lambda inputs: (stage(inputs), events.append("staged"))[0]
    runner.model.forward = lambda *args: (events.append("forward"), forward(*args))[1]
    runner.on_forward_start = lambda: events.append("hook")
    scheduler.add_request(_seeded("a", 0))
    for _ in range(2):  # the prefill, then a decode fed from the device
        step = scheduler.schedule()
        runner.execute_model(step)
        scheduler.sampling_issued(step)
        scheduler.update_from_output(step, runner.sample_tokens(None).get_output())
    assert events == ["staged", "hook", "forward"] * 2
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    empty = scheduler.schedule()
    assert empty.total_num_scheduled_tokens == 0
    runner.execute_model(empty)
    runner.sample_tokens(None)
    assert events == ["staged", "hook", "forward"] * 2


def test_several_unsampled_steps_sample_in_order_after_rows_moved() -> None:
    """Step B is executed but not sampled (a deferred step) when step C's forward runs and
    drops a finished request, which moves another request's row. Sampling B afterwards must
    give what sampling it right away gives: the states, seeds and device-side feedback
    follow the requests, not the rows they had when B ran."""
    from vllm.v1.request import RequestStatus

    config, _, scheduler = _runner_and_scheduler()
    for i, req_id in enumerate("abc"):
        scheduler.add_request(_seeded(req_id, i))
    step_a = scheduler.schedule()
    scheduler.sampling_issued(step_a)
    step_b = scheduler.schedule()  # a, b, c again; its sampling stays deferred
    assert step_b.sampled_req_ids == ["a", "b", "c"]
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(_seeded("d", 3))
    step_c = scheduler.schedule()
    # b and c wait for B's sampling (their input token); only the new request runs.
    assert list(step_c.num_scheduled_tokens) == ["d"] and "a" in step_c.finished_req_ids

    def run(overlapped: bool):
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runner = GPUModelRunner(config)
        runner.load_model()
        runner.initialize_kv_cache(32)
        outs = {}
        runner.execute_model(step_a)
        outs["a"] = runner.sample_tokens(None).get_output()
        runner.execute_model(step_b)
        if overlapped:
            runner.execute_model(step_c)  # drops a: c's row moves into a's
            outs["b"] = runner.sample_tokens(None).get_output()
        else:
            outs["b"] = runner.sample_tokens(None).get_output()
            runner.execute_model(step_c)
        outs["c"] = runner.sample_tokens(None).get_output()
        return runner, outs

    serial_runner, serial = run(False)
    overlapped_runner, overlapped = run(True)
    for name in "abc":
        assert overlapped[name].req_ids == serial[name].req_ids
        assert overlapped[name].sampled_token_ids == serial[name].sampled_token_ids, name
        assert overlapped[name].logprobs == serial[name].logprobs, name
    # One more step feeds b and c from the device: their tokens from B must be where
    # their rows are now.
    for step, name in ((step_a, "a"), (step_b, "b"), (step_c, "c")):
        scheduler.sampling_issued(step)
        scheduler.update_from_output(step, overlapped[name])
    step_d = scheduler.schedule()
    assert set(step_d.num_scheduled_tokens) == {"b", "c", "d"}
    results = []
    for runner in (serial_runner, overlapped_runner):
        runner.execute_model(step_d)
        results.append(runner.sample_tokens(None).get_output())
    assert results[0].sampled_token_ids == results[1].sampled_token_ids
    assert results[0].logprobs == results[1].logprobs
    with pytest.raises(RuntimeError, match="without an executed"):
        overlapped_runner.sample_tokens(None)
    scheduler.finish_requests(["b", "c", "d"], RequestStatus.FINISHED_ABORTED)


# ---------------------------------------------------------------------- row order across ranks


class _ReversedSet(set):
    """A set that iterates in the reverse of a plain set's order, as a set of strings may in
    another process (string hashes are salted per process)."""

    def __iter__(self):
        return reversed(list(set.__iter__(self)))


def test_row_order_does_not_depend_on_set_iteration_order() -> None:
    """Every rank of a parallel engine unpickles the same SchedulerOutput, but its sets of
    finished and preempted ids iterate in a per-process order. The rows (and so the token
    order of every tensor the ranks exchange) must come out the same anyway."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    _, first, _ = _runner_and_scheduler()
    _, second, _ = _runner_and_scheduler()
    ids = [f"r{i}" for i in range(6)]
    new = [
        NewRequestData(r, [100 + i, 200 + i], SamplingParams(max_tokens=4), [i], 0)
        for i, r in enumerate(ids)
    ]
    start = SchedulerOutput(new, CachedRequestData(), {r: 2 for r in ids}, 12, set())
    for runner in (first, second):
        runner._update_states(start)
    gone = {"r0", "r2", "r3"}
    for runner, finished in ((first, set(gone)), (second, _ReversedSet(gone))):
        runner._update_states(SchedulerOutput([], CachedRequestData(), {}, 0, finished))
    assert first.input_batch.req_ids == second.input_batch.req_ids


# ---------------------------------------------------------------------- fast-forward tokens


def test_fast_forward_tokens_get_no_logits_and_change_no_sample() -> None:
    """Drafts scheduled as fast-forward tokens (each the only token its position allows)
    enter the forward pass, but only the position after them gets a logits row; the output
    is the tokens then that row's sample, which is what decoding them one by one samples
    there (the seed is keyed by output position, so skipping samples shifts nothing)."""
    from tests.v1.core.sched_utils import EOS_IDS, demo_model_config, make_config, make_kv
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    config = make_config(demo_model_config(), num_blocks=32, num_speculative_tokens=3)

    def start() -> tuple[GPUModelRunner, Scheduler]:
        runner = GPUModelRunner(config)
        runner.load_model()
        runner.initialize_kv_cache(32)
        scheduler = Scheduler(config, make_kv(config))
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
        params.update_from_model(EOS_IDS)
        scheduler.add_request(Request("r", [100, 301, 502, 703, 904], params))
        return runner, scheduler

    def step(runner: GPUModelRunner, scheduler: Scheduler, output=None) -> list[int]:
        output = output or scheduler.schedule()
        runner.execute_model(output)
        result = runner.sample_tokens(None)
        scheduler.update_from_output(output, result)
        return result.sampled_token_ids[0]

    runner, scheduler = start()
    want = [tok for _ in range(4) for tok in step(runner, scheduler)]
    runner, scheduler = start()
    assert step(runner, scheduler) == want[:1]
    output = scheduler.schedule()
    assert not output.scheduled_spec_decode_tokens  # nothing to look up in this prompt
    # The two tokens after want[0] as fast-forward tokens (slots: 4-token blocks hold them).
    output.scheduled_spec_decode_tokens = {"r": want[1:3]}
    output.num_fast_forward_tokens = {"r": 2}
    output.num_scheduled_tokens["r"] += 2
    output.total_num_scheduled_tokens += 2
    runner.execute_model(output)
    assert runner._steps[-1].logits.shape[0] == 1
    assert runner.sample_tokens(None).sampled_token_ids[0] == want[1:4]
