"""Smoke test of benchmarks/train_eagle3.py: a few self-distillation steps on demo-tiny fit
its own text (the loss falls), and the head it writes is read, checked and served by the
engine, drafting."""

from __future__ import annotations

from tests.benchmarks.scripts import load_script
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.transformers_utils.eagle3_config import read_eagle3_head

train_eagle3 = load_script("train_eagle3")


def test_a_few_steps_fit_the_text_and_write_a_head_the_engine_serves(tmp_path) -> None:
    out = tmp_path / "head"
    losses = train_eagle3.run(train_eagle3.parse([
        "--model", "demo-tiny", "--out", str(out), "--num-prompts", "2", "--output-len", "8",
        "--steps", "8", "--draft-vocab", "64", "--lr", "3e-3"]))
    assert len(losses) == 8
    # The two sequences take turns: each is fitted better the fourth time than the first.
    assert losses[6] < losses[0] and losses[7] < losses[1]
    target = EngineArgs(model="demo-tiny").create_engine_config().model_config.hf_config
    config = read_eagle3_head(out, target)
    assert (config.layout, config.draft_vocab_size, config.aux_layer_ids) == ("eagle3", 64,
                                                                              (0, 1, 2))
    assert not config.has_embedding  # the target's is shared
    llm = LLM("demo-tiny", max_num_seqs=2, speculative_config={
        "method": "eagle3", "model": str(out), "num_speculative_tokens": 2})
    try:
        outs = llm.generate(["a story about tea"], SamplingParams(max_tokens=8, temperature=0.0,
                                                                  ignore_eos=True),
                            use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == 8
        assert llm.llm_engine.engine_core.scheduler.drafter.stats.num_draft_tokens > 0
    finally:
        llm.shutdown()
