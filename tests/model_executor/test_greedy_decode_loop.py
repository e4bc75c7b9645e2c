"""Tests for vllm/model_executor/greedy_decode_loop.py: the bare decode loop gives the engine's greedy
tokens, so the engine / bare-loop throughput ratio compares the same work."""

from __future__ import annotations

import random

import pytest

from tests.utils_models import TINY, build_checkpoint
from vllm import LLM, SamplingParams
from vllm.model_executor.greedy_decode_loop import BareDecoder, _prefill_groups
from vllm.model_executor.model_loader.demo_model import build_demo_model

MAX_TOKENS = 12


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_same_greedy_tokens_as_the_engine(arch: str, tmp_path) -> None:
    build_checkpoint(arch, tmp_path, seed=3)
    rng = random.Random(arch)
    lengths = (1, 5, 13, 5, 30, 30)  # repeated lengths prefill together
    prompts = [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in lengths]
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


def test_cpu_weights_are_column_major_like_the_engines(tmp_path) -> None:
    # The ceiling must multiply with the engine's fastest layout: on the CPU the engine keeps
    # every dense weight column-major (vllm/model_executor/layers/column_major.py), whose GEMM
    # beat the row-major one at a batch of 64 and whose GEMV beats it at one row.
    build_checkpoint("llama", tmp_path, seed=1)
    bare = BareDecoder(tmp_path)
    matrices = {name: w for name, w in bare.w.items() if w.dim() == 2}
    assert matrices and "model.layers.0.self_attn.qkv_proj.weight" in matrices
    for name, w in matrices.items():
        assert w.t().is_contiguous(), f"{name} is not column-major"
    assert bare.head.t().is_contiguous()


def test_prompts_of_one_length_prefill_together_within_a_token_budget(monkeypatch) -> None:
    prompts = [[1] * 3, [2] * 5, [3] * 3, [4] * 3, [5] * 5]
    assert _prefill_groups(prompts) == [[0, 2, 3], [1, 4]]
    monkeypatch.setattr("vllm.model_executor.greedy_decode_loop._PREFILL_TOKENS", 6)
    assert _prefill_groups(prompts) == [[0, 2], [3], [1], [4]]
