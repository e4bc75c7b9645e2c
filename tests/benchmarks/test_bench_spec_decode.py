"""Tests for benchmarks/bench_spec_decode.py's timed runs (tokens/s, drafts, forwards)."""

from __future__ import annotations

import pytest

from tests.benchmarks.scripts import load_script
from vllm import LLM, SamplingParams

load_script("bench_offline")  # bench_spec_decode imports it by name
bench_spec_decode = load_script("bench_spec_decode")

OUTPUT_LEN = 16


@pytest.fixture(scope="module")
def llm():
    llm = LLM("demo-tiny", max_num_seqs=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    yield llm
    llm.shutdown()


def test_forwards_count_the_steps_that_ran(llm) -> None:
    scheduler = llm.llm_engine.engine_core.scheduler
    proposer = scheduler.drafter.proposer
    prompts = bench_spec_decode.repetitive_prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    plain = bench_spec_decode.timed(llm, prompts, params, False, proposer)
    # Both prompts are admitted in the first step, which samples the first token; each
    # later step samples one more.
    assert plain["forwards"] == OUTPUT_LEN
    assert plain["steps"] == plain["drafted"] == 0
    drafted = bench_spec_decode.timed(llm, prompts, params, True, proposer)
    assert drafted["accepted"] > 0
    assert drafted["forwards"] < OUTPUT_LEN
    assert "schedule" not in vars(scheduler)  # the counting wrapper is gone
