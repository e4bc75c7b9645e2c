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
    # A verification that kept j drafts counts once at each of positions 0 .. j-1.
    per_pos = drafted["accepted_per_pos"]
    assert 0 < len(per_pos) <= 3 and sum(per_pos) == drafted["accepted"]
    assert per_pos == sorted(per_pos, reverse=True)
    assert drafted["forwards"] < OUTPUT_LEN
    assert "schedule" not in vars(scheduler)  # the counting wrapper is gone


def test_eagle3_drafts_off_switch_the_runners_head_off(tmp_path) -> None:
    """With --method eagle3, drafts off is an engine without the head: the runner proposes
    nothing and the target copies no hidden states; on again, the head drafts and its
    drafts are kept (a head that echoes demo-tiny's own predictions, tests/utils_eagle3.py)."""
    from transformers import AutoConfig

    from tests.utils_eagle3 import write_eagle3_head
    from vllm.model_executor.model_loader.demos import resolve_model_dir

    target = resolve_model_dir("demo-tiny")
    head = write_eagle3_head(tmp_path / "head", AutoConfig.from_pretrained(target),
                             aux_layer_ids=[0, 1, 2], draft_vocab=list(range(32000)),
                             echo=target, scale=0.002)
    llm = LLM("demo-tiny", max_num_seqs=4, speculative_config={
        "method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    try:
        runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
        proposer = llm.llm_engine.engine_core.scheduler.drafter.proposer
        eagle3, calls = runner.eagle3, []
        propose = eagle3.propose
        eagle3.propose = lambda *args: calls.append(1) or propose(*args)
        prompts = bench_spec_decode.repetitive_prompts(2)
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
        plain = bench_spec_decode.timed(llm, prompts, params, False, proposer)
        assert plain["drafted"] == 0 and not calls
        assert runner.eagle3 is None and runner.model.model._aux_slots == {}
        drafted = bench_spec_decode.timed(llm, prompts, params, True, proposer)
        assert runner.eagle3 is eagle3 and calls
        assert drafted["accepted"] > 0 and drafted["forwards"] < OUTPUT_LEN
    finally:
        llm.shutdown()
