"""LoRA adapters over quantized base layers: the adapter's delta adds to the packed layer's
output. Oracle: peft's merge_and_unload() of the adapter on transformers' dequantized model
gives the engine's greedy tokens and logits (within 1e-4, float32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.lora.utils import ALL_TARGETS, build_adapter
from tests.utils_models import TINY, capture_logits
from tests.utils_quant import packed_checkpoint
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader.demo_model import build_demo_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.slow
def test_adapter_on_gptq_row_and_column_layers(tmp_path: Path) -> None:
    oracle = packed_checkpoint("llama", tmp_path / "model", "gptq", 70, act_order=True)
    merged = build_adapter(oracle, tmp_path / "adapter", seed=71, targets=ALL_TARGETS)
    llm = LLM(model=str(tmp_path / "model"), tokenizer=str(build_demo_model("demo-tiny")),
              dtype="float32", enable_lora=True, max_model_len=128, block_size=4)
    try:
        runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
        assert runner.model.model.layers[0].self_attn.o_proj.base.quant_method is not None
        captured = capture_logits(llm)
        rng = random.Random(0)
        prompts = [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in (4, 11)]
        lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False,
                                                      lora_request=lora)):
            tokens = out.outputs[0].token_ids
            with torch.inference_mode():
                want = merged(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
            got = torch.stack(captured[out.request_id])
            assert (got - want).abs().max().item() < 1e-4
            assert tokens == want.argmax(-1).tolist()
    finally:
        llm.shutdown()
