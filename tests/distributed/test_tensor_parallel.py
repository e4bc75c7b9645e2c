"""Oracle: tensor parallelism agrees with one rank.

Two ranks reduce in a different order than one, so tokens may rarely differ: at least 90 %
of prompts must give the same greedy tokens as `-tp 1`, and where the tokens agree the
logprobs must be within 1e-4. `-tp 2 -pp 2` (four ranks on however many cores) must serve
structured requests, and a killed rank must end in an error, not a hang.
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


def assert_agree(got: list, want: list, min_fraction: float = 0.9) -> None:
    """At least `min_fraction` of the outputs have identical tokens; where tokens agree
    (up to the first difference) the logprobs are within 1e-4."""
    same = 0
    for a, b in zip(got, want, strict=True):
        same += a.token_ids == b.token_ids
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if ta != tb:
                break
            for token in la.keys() & lb.keys():
                assert abs(la[token].logprob - lb[token].logprob) < 1e-4, (token, la[token], lb[token])
    assert same >= min_fraction * len(want), f"only {same} of {len(want)} outputs agree"


def _demo_outputs(**kwargs) -> list:
    llm = LLM("demo-tiny", max_model_len=128, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
        return [o.outputs[0] for o in llm.generate(DEMO_PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_agree_with_one_on_the_demo_model() -> None:
    want = _demo_outputs(async_scheduling=False)
    assert_agree(_demo_outputs(tensor_parallel_size=2, async_scheduling=True), want)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_agree_with_one_on_hf_checkpoints(checkpoint: Path) -> None:
    assert_agree(hf_outputs(checkpoint, tensor_parallel_size=2), hf_outputs(checkpoint))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_ranks_serve_structured_requests() -> None:
    constraint = StructuredOutputsParams(
        json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        disable_any_whitespace=True,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    structured = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=constraint)
    llm = LLM("demo-tiny", max_model_len=128, tensor_parallel_size=2,
              pipeline_parallel_size=2, async_scheduling=True)
    try:
        assert len(llm.llm_engine.engine_core.model_executor.worker_pids) == 4
        params = [plain, structured] * (len(DEMO_PROMPTS) // 2)
        outs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
        for p, o in zip(params, outs):
            assert len(o.outputs[0].token_ids) > 0
            if p.structured_outputs is not None:
                check_structured_output(p.structured_outputs, o.outputs[0], llm.get_tokenizer())
            else:
                assert len(o.outputs[0].token_ids) == 16
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
