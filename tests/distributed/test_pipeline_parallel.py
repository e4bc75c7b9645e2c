"""Oracle: pipeline parallelism gives exactly what one stage gives.

Two stages (`-pp 2`, two worker processes talking over gloo) must produce the tokens and
logprobs of the one-rank engine, sync and async, with 0/50/100 % structured requests, with
forced preemption and with chunked prefill, on the demo model; and greedy tokens and
logprobs of random Qwen3, Qwen2 and Llama checkpoints. Logprobs are compared exactly, except
with chunked prefill or forced preemption (within 1e-5: the layouts batch differently, so
prompts are split or recomputed at other points, which rounds differently).

Two things outside the layout change numbers on a CPU, so both runs fix them: every rank runs
one thread (see `one_thread_per_rank`), and prefix caching is off (which blocks are cached
depends on batch timing, and a cache hit computes the prompt's attention in another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.conftest import hf_outputs
from tests.v1.engine.test_async_sync_equivalence import CONDITIONS, generate_all
from vllm import LLM


def assert_identical(got: dict[float, list], want: dict[float, list], tol: float = 0.0) -> None:
    """Same tokens and finish reasons; logprobs equal (within `tol`: exactly by default,
    since stages change no arithmetic)."""
    for ratio in want:
        for i, (a, b) in enumerate(zip(got[ratio], want[ratio], strict=True)):
            assert a.token_ids == b.token_ids, (ratio, i)
            assert a.finish_reason == b.finish_reason, (ratio, i)
            if tol == 0.0 or b.logprobs is None:
                assert a.logprobs == b.logprobs, (ratio, i)
                continue
            for la, lb in zip(a.logprobs, b.logprobs, strict=True):
                assert la.keys() == lb.keys(), (ratio, i)
                assert max(abs(la[k].logprob - lb[k].logprob) for k in lb) <= tol, (ratio, i)


pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


@pytest.fixture(scope="module")
def reference(one_thread_per_rank) -> dict[float, list]:
    llm = LLM("demo-tiny", max_model_len=128, max_num_seqs=16, enable_prefix_caching=False,
              async_scheduling=False)
    try:
        return generate_all(llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "async_scheduling, condition",
    # No case here caches prefixes, so a plain async run is a subset of the preempted one.
    [(True, "preemption"), (False, "chunked")],
)
def test_two_stages_match_one(reference, async_scheduling: bool, condition: str) -> None:
    kwargs = {"enable_prefix_caching": False, **CONDITIONS[condition]}
    llm = LLM("demo-tiny", max_model_len=128, max_num_seqs=16, pipeline_parallel_size=2,
              async_scheduling=async_scheduling, **kwargs)
    try:
        core = llm.llm_engine.engine_core
        assert core.batch_queue_size == 2
        got = generate_all(llm)
        if condition == "preemption":
            assert core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    # Where a prompt is split into chunks, or a request preempted and its KV recomputed in
    # one prefill, depends on what else is in the batch, and a differently split attention
    # rounds differently; tokens must still agree exactly.
    assert_identical(got, reference, tol=0.0 if condition == "plain" else 1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_stages_match_one_on_hf_checkpoints(checkpoint: Path) -> None:
    want = hf_outputs(checkpoint)
    got = hf_outputs(checkpoint, pipeline_parallel_size=2, async_scheduling=True)
    assert_identical({0.0: got}, {0.0: want})
