"""Tests for vllm/model_executor/bare_decoder.py: the bare decode loop gives the engine's greedy
tokens, so the engine / bare-loop throughput ratio compares the same work."""

from __future__ import annotations

import random

import pytest

from tests.utils_models import TINY, build_checkpoint
from vllm import LLM, SamplingParams
from vllm.model_executor.bare_decoder import BareDecoder
from vllm.model_executor.model_loader.demo_model import build_demo_model

MAX_TOKENS = 12


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_same_greedy_tokens_as_the_engine(arch: str, tmp_path) -> None:
    build_checkpoint(arch, tmp_path, seed=3)
    rng = random.Random(arch)
    prompts = [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in (1, 5, 13, 30)]
    bare = BareDecoder(tmp_path).generate(prompts, MAX_TOKENS)
    llm = LLM(model=str(tmp_path), tokenizer=str(build_demo_model("demo-tiny")),
              dtype="float32", max_model_len=128)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    engine = [list(o.outputs[0].token_ids) for o in outs]
    assert bare == engine
    if arch != "qwen3":  # a tied head makes each token its own likeliest successor
        # Order-one weights: the continuations are not one repeated token.
        assert all(len(set(tokens)) > 1 for tokens in bare)


def test_unsupported_checkpoints_are_refused(tmp_path) -> None:
    build_checkpoint("llama3_rope", tmp_path, seed=0)
    with pytest.raises(ValueError, match="RoPE scaling"):
        BareDecoder(tmp_path)
