"""Model-runner behaviour that only shows when device-to-host copies lag (as on CUDA)."""

from __future__ import annotations

import random

import pytest

from vllm import LLM, SamplingParams
from vllm.v1.worker import gpu_model_runner


def _workload():
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    prompts = [" ".join(rng.choices(words, k=rng.randint(2, 40))) for _ in range(24)]
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


def _run(async_scheduling: bool, **kwargs):
    prompts, params = _workload()
    llm = LLM("demo-tiny", max_model_len=128, max_num_seqs=16,
              async_scheduling=async_scheduling, **kwargs)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine.engine_core.scheduler
    finally:
        llm.shutdown()


def test_lagging_copies_with_preemption_match_sync(monkeypatch) -> None:
    """A request preempted with a token in flight resumes holding that token; when the copy
    lands later, the runner must not append it a second time."""
    want, _ = _run(False)
    newest: list[object] = [None]
    original_init = gpu_model_runner._SampledTokens.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        newest[0] = self

    monkeypatch.setattr(gpu_model_runner._SampledTokens, "__init__", init)
    # The newest copy never counts as landed at non-blocking settles, as on a busy GPU.
    monkeypatch.setattr(gpu_model_runner._SampledTokens, "ready", lambda self: self is not newest[0])
    for num_blocks in (56, 64):
        got, scheduler = _run(True, block_size=4, num_gpu_blocks_override=num_blocks,
                              enable_prefix_caching=False)
        assert scheduler.num_preemptions > 0
        assert got == want, num_blocks
