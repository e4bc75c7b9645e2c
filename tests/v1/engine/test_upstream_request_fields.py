"""Upstream vLLM's per-request scheduling and cache fields, end to end in one offline engine
(demo-tiny, --scheduling-policy priority, two sequences at once, a 6-block KV cache): a
request's `priority`, a prompt's `cache_salt`, and `repetition_detection` (also inside a
JSON string a grammar cannot end)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.v1.core.test_repetition import repeated_tail
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.exceptions import InvalidRequestError
from vllm.sampling_params import RepetitionDetectionParams
from vllm.v1.engine.llm_engine import LLMEngine

BLOCK = 16
NUM_BLOCKS = 6  # 96 tokens: two 80-token requests cannot both fit


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM("demo-tiny", max_model_len=NUM_BLOCKS * BLOCK, max_num_seqs=2,
              scheduling_policy="priority", block_size=BLOCK,
              num_gpu_blocks_override=NUM_BLOCKS)
    yield llm
    llm.shutdown()


def finish_steps(engine: LLMEngine) -> dict[str, int]:
    """Steps the engine until it is idle; returns the step each request finished in."""
    finished: dict[str, int] = {}
    for step in range(1, 2000):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = step
    raise AssertionError("the engine did not finish its requests")


def test_a_high_priority_request_admitted_after_low_ones_runs_first(llm: LLM) -> None:
    engine = llm.llm_engine
    low = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"low{i}", f"Low priority request number {i}", low, priority=5)
    while len(engine.engine_core.scheduler.running) < 2:
        engine.step()
    # The batch is full (max_num_seqs 2) of low requests; two more wait.
    high = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("high", "An urgent request", high, priority=-1)
    finished = finish_steps(engine)
    # It takes the first free slot, before the low requests that were waiting before it
    # (first come first served would run it last).
    assert finished["high"] < min(finished["low2"], finished["low3"])
    assert finished["high"] > min(finished["low0"], finished["low1"])


def test_preemption_takes_the_lowest_priority_request(llm: LLM) -> None:
    engine = llm.llm_engine
    sched = engine.engine_core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("low", list(range(1000, 1020)), params, priority=5)
    while "low" not in {r.request_id for r in sched.running}:
        engine.step()
    engine.add_request("high", list(range(2000, 2020)), params, priority=0)
    requests = {r: sched.requests[r] for r in ("low", "high")}
    before = sched.num_preemptions
    finished = finish_steps(engine)
    # 80 tokens each in a 96-token cache: one of them must be preempted, and under the
    # priority policy it is the low one (first come first served preempts the newest).
    assert sched.num_preemptions > before
    assert requests["low"].num_preemptions >= 1
    assert requests["high"].num_preemptions == 0
    assert finished["high"] < finished["low"]
    assert len(requests["low"].output_token_ids) == 60


def test_generate_takes_one_priority_per_prompt(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2)
    outs = llm.generate(["first", "second"], params, use_tqdm=False, priority=[3, -3])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["first", "second"], params, use_tqdm=False, priority=[1])
    assert e.value.param == "priority"


def test_cache_salt_separates_prefix_cache_entries(llm: LLM) -> None:
    prompt = list(range(3000, 3000 + 2 * BLOCK + 8))  # two full blocks, then 8 tokens

    def cached_tokens(salt: str | None) -> int:
        request = {"prompt_token_ids": prompt}
        if salt is not None:
            request["cache_salt"] = salt
        params = SamplingParams(temperature=0.0, max_tokens=1)
        return llm.generate(request, params, use_tqdm=False)[0].num_cached_tokens

    assert cached_tokens("alice") == 0
    assert cached_tokens("bob") == 0  # same prompt, another salt: nothing shared
    assert cached_tokens("alice") == 2 * BLOCK  # same salt: both full blocks hit
    assert cached_tokens(None) == 0  # no salt never shares with a salt
    with pytest.raises(InvalidRequestError) as e:
        llm.generate({"prompt_token_ids": prompt, "cache_salt": ""}, use_tqdm=False)
    assert e.value.param == "cache_salt"


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "json-string"])
def test_repetition_detection_stops_a_looping_request(llm: LLM, constrained: bool) -> None:
    # Greedy decoding of the random demo model falls into a loop within a few tokens; inside
    # a JSON string that must be long, the grammar cannot end it either.
    structured = None
    if constrained:
        schema = {"type": "object", "required": ["name"],
                  "properties": {"name": {"type": "string", "minLength": 500}}}
        structured = StructuredOutputsParams(json=schema)
    detect = RepetitionDetectionParams(max_pattern_size=4, min_count=4)
    base = dict(temperature=0.0, max_tokens=40, ignore_eos=True, structured_outputs=structured)
    free_run = llm.generate("Tell me a story", SamplingParams(**base), use_tqdm=False)
    looped = free_run[0].outputs[0]
    assert (looped.finish_reason, len(looped.token_ids)) == ("length", 40)
    stopped = llm.generate("Tell me a story", SamplingParams(**base, repetition_detection=detect),
                           use_tqdm=False)[0].outputs[0]
    tokens = list(stopped.token_ids)
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", "repetition_detected")
    assert len(tokens) < 40
    # The same greedy path, cut at the first point where its tail repeats.
    assert tokens == list(looped.token_ids[:len(tokens)])
    assert repeated_tail(tokens, detect) is not None
    assert all(repeated_tail(tokens[:k], detect) is None for k in range(1, len(tokens)))
