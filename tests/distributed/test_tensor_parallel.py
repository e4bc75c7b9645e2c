"""Oracle: tensor parallelism agrees with one rank.

Every rank runs one thread (see `one_thread_per_rank`), yet exact equality is still not a
property of the layout: a row-parallel layer (attention output, MLP down projection) sums
each rank's partial product in the all-reduce, a float32 sum in another order than the one
matmul of `-tp 1`, so logits differ in the last bits. So on every prompt the greedy tokens
of `-tp 2` must equal `-tp 1`'s up to the first step where `-tp 1`'s top two logprobs are
within NEAR_TIE of each other (and there only a token of that tie may be taken instead);
the logprobs must be within 1e-4 at every step compared. `-tp 2 -pp 2` (four ranks on
however many cores) must give the same greedy tokens by the same rule and serve structured
requests (with grammar fast-forward), and a killed rank must end in an error, not a hang.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.distributed.conftest import hf_outputs
from tests.v1.structured_output.oracle import check_structured_output
from vllm import LLM, SamplingParams, StructuredOutputsParams

DEMO_PROMPTS = [
    "Hello world", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,",
    "The capital of France is", "import numpy as np", "SELECT * FROM", "Dear Sir or Madam,",
    "In the beginning", "for i in range(", "The quick brown fox", "<html><body>",
]


# Logits of two layouts differ by ~1e-6; a top-two margin of 1e-3 is far above that and
# still almost never met by a random model's logits.
NEAR_TIE = 1e-3

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


def assert_agree(got: list, want: list, tol: float = 1e-4) -> None:
    """Every output has `want`'s tokens, except that from a step where `want`'s top two
    logprobs are within NEAR_TIE it may go on with the other token of the tie (the steps
    after it are not compared). Where `got` has logprobs, they are within `tol` of `want`'s
    at every step compared."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert len(a.token_ids) == len(b.token_ids), i
        for step, (ta, tb, lb) in enumerate(zip(a.token_ids, b.token_ids, b.logprobs)):
            if a.logprobs is not None:
                la = a.logprobs[step]
                for token in la.keys() & lb.keys():
                    assert abs(la[token].logprob - lb[token].logprob) < tol, (i, step, token)
            if ta == tb:
                continue
            assert ta in lb, (i, step, ta, lb)
            margin = lb[tb].logprob - lb[ta].logprob
            assert margin < NEAR_TIE, f"output {i} differs at step {step} (margin {margin})"
            break


def _demo_outputs(**kwargs) -> list:
    llm = LLM("demo-tiny", max_model_len=128, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
        return [o.outputs[0] for o in llm.generate(DEMO_PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def one_rank(one_thread_per_rank) -> list:
    """`-tp 1`'s greedy outputs of DEMO_PROMPTS, with logprobs (shared by the layouts)."""
    return _demo_outputs(async_scheduling=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_agree_with_one_on_the_demo_model(one_rank: list) -> None:
    assert_agree(_demo_outputs(tensor_parallel_size=2, async_scheduling=True), one_rank)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_agree_with_one_on_hf_checkpoints(checkpoint: Path) -> None:
    assert_agree(hf_outputs(checkpoint, tensor_parallel_size=2), hf_outputs(checkpoint))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_ranks_agree_with_one_and_serve_structured_requests(one_rank: list) -> None:
    constraint = StructuredOutputsParams(
        json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        disable_any_whitespace=True,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    structured = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=constraint)
    # Grammar fast-forward too: constrained requests draft their forced tokens across the
    # ranks; unconstrained ones never draft, so their tokens stay comparable.
    llm = LLM("demo-tiny", max_model_len=128, tensor_parallel_size=2,
              pipeline_parallel_size=2, async_scheduling=True,
              structured_outputs_config={"fast_forward": "canonical"})
    try:
        assert len(llm.llm_engine.engine_core.model_executor.worker_pids) == 4
        params = [plain, structured] * (len(DEMO_PROMPTS) // 2)
        outs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
        plain_outs = [o.outputs[0] for o in outs[::2]]
        assert_agree(plain_outs, one_rank[::2])
        for p, o in zip(params, outs):
            assert len(o.outputs[0].token_ids) > 0
            if p.structured_outputs is not None:
                check_structured_output(p.structured_outputs, o.outputs[0], llm.get_tokenizer())
            else:
                assert len(o.outputs[0].token_ids) == 16
        stats = llm.llm_engine.engine_core.scheduler.drafter.stats
        assert stats.num_forced_kept_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.timeout(120)
def test_a_killed_rank_is_an_error_not_a_hang() -> None:
    # The mp executor's failure path does not depend on the layout (its own tests kill
    # workers too); pipeline stages die the same way.
    llm = LLM("demo-tiny", max_model_len=128, tensor_parallel_size=2)
    try:
        executor = llm.llm_engine.engine_core.model_executor
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        # A hang fails the test at its timeout marker.
        with pytest.raises(Exception, match=r"rank 1 .*died"):
            llm.generate(DEMO_PROMPTS, SamplingParams(max_tokens=64, ignore_eos=True),
                         use_tqdm=False)
    finally:
        llm.shutdown()
