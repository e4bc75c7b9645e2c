"""Quantized checkpoints through the whole offline engine (scheduler, KV cache, model
runner, sampler) against transformers running the dequantized weights.

Oracle: for 8 prompts x 32 greedy tokens, the engine's tokens equal transformers' greedy
choice on at least 90% of the prompts, and where they agree the per-step logits are within
1e-4 (float32 on the CPU, where the engine dequantizes exactly as the oracle's weights
were made). Also: a quantized model under async scheduling with a JSON schema constraint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.utils_models import TINY, capture_logits
from tests.utils_quant import ct_checkpoint, ct_write, fp8_rows_oracle, packed_checkpoint
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.model_executor.model_loader.demo_model import build_demo_model

PROMPT_LENS = [3, 7, 12, 20, 5, 33, 1, 17]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
FORMATS = {
    "ct_w4a16": (lambda p: ct_checkpoint("qwen3", p, "w4a16", 60), None),
    "gptq_act_order": (lambda p: packed_checkpoint("qwen3", p, "gptq", 61, act_order=True,
                                                   sym=False), "gptq"),
    "fp8_online": (lambda p: fp8_rows_oracle("llama", p, 62), "fp8"),
}


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    return str(build_demo_model("demo-tiny"))


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_tokens_and_logits_match_dequantized(name: str, tokenizer_dir: str,
                                                    tmp_path: Path) -> None:
    make, quantization = FORMATS[name]
    oracle = make(tmp_path)
    llm = LLM(model=str(tmp_path), tokenizer=tokenizer_dir, dtype="float32", block_size=4,
              max_model_len=128, max_num_batched_tokens=16, quantization=quantization)
    try:
        captured = capture_logits(llm)
        prompts = _prompts(seed=len(name))
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        agree = 0
        for prompt, out in zip(prompts, outputs):
            tokens = out.outputs[0].token_ids
            assert len(tokens) == MAX_TOKENS
            with torch.inference_mode():
                want = oracle(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
            if tokens == want.argmax(-1).tolist():
                agree += 1
                got = torch.stack(captured[out.request_id])
                assert (got - want).abs().max().item() < 1e-4
        assert agree >= 0.9 * len(prompts)
    finally:
        llm.shutdown()


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.mark.slow
def test_json_under_async_scheduling(tokenizer_dir: str, tmp_path: Path) -> None:
    # The demo model (its tokenizer's whole vocabulary), quantized to FP8.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tokenizer_dir, dtype=torch.float32)
    ct_write(hf, tmp_path, "fp8_channel")
    llm = LLM(model=str(tmp_path), tokenizer=tokenizer_dir, dtype="float32",
              max_model_len=128, async_scheduling=True)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=(
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)))
        outputs = llm.generate(["Reply in JSON:", "Is it ok?", "{"], params, use_tqdm=False)
        for out in outputs:
            assert out.outputs[0].finish_reason == "stop"
            assert isinstance(json.loads(out.outputs[0].text)["ok"], bool)
        runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
        qkv = runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn
    finally:
        llm.shutdown()
