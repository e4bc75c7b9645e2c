"""Random Hugging Face checkpoints and a greedy workload shared by the parallelism oracles."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils_models import build_checkpoint
from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader.demo_model import build_demo_model

HF_PROMPTS = [[(7 * i + 3 * k) % 500 + 1 for k in range(4 + 3 * i)] for i in range(6)]


def hf_outputs(model: Path, **kwargs) -> list:
    """Greedy tokens and logprobs of HF_PROMPTS on a random checkpoint (the demo model's
    tokenizer: the prompts and outputs are ids below the checkpoint's vocabulary)."""
    llm = LLM(str(model), tokenizer=str(build_demo_model("demo-tiny")), dtype="float32",
              max_model_len=128, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in HF_PROMPTS], params,
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0] for o in outs]


# Qwen3 runs through every engine test here as demo-tiny; Llama differs from Qwen2 only by
# the attention biases, and every architecture's layers are split and compared at the model
# level (tests/model_executor/models/). Qwen2 adds what the engine tests lack: biased
# projections to shard and an untied LM head.
@pytest.fixture(scope="package", params=["qwen2"])
def checkpoint(request, tmp_path_factory) -> Path:
    """A random tiny checkpoint of an architecture other than the demo model's."""
    path = tmp_path_factory.mktemp(request.param)
    build_checkpoint(request.param, path, seed=3)
    return path
