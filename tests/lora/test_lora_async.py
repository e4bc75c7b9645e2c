"""Oracle: with adapters, async scheduling (also with workers in their own processes, and
with n-gram drafts) gives exactly what synchronous scheduling in one process gives,
structured-output requests included."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.lora.utils import ALL_TARGETS, build_adapter
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader.demo_model import build_demo_model

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["a", "b", "c"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo_adapters(tmp_path_factory):
    """The demo-tiny model dir and two adapters for it."""
    from transformers import AutoModelForCausalLM

    model_dir = build_demo_model("demo-tiny")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    root = tmp_path_factory.mktemp("demo_lora")
    build_adapter(hf, root / "one", seed=1, targets=ALL_TARGETS, r=4)
    build_adapter(hf, root / "two", seed=2, targets=["q_proj", "up_proj"], r=8)
    return str(model_dir), [LoRARequest("one", 1, str(root / "one")),
                            LoRARequest("two", 2, str(root / "two"))]


def _requests(loras):
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    prompts, params, chosen = [], [], []
    for i in range(8):
        prompts.append(" ".join(rng.choices(words, k=rng.randint(2, 20))))
        kw = dict(max_tokens=24, ignore_eos=i % 2 == 0)
        if i % 3 == 1:
            kw.update(temperature=1.0, seed=100 + i)
        else:
            kw.update(temperature=0.0)
        if i in (2, 5):
            kw.update(structured_outputs=StructuredOutputsParams(
                json=SCHEMA, disable_any_whitespace=True), ignore_eos=False, max_tokens=40)
        params.append(SamplingParams(**kw))
        chosen.append([None, loras[0], loras[1]][i % 3])
    return prompts, params, chosen


def _run(model_dir, loras, **kwargs):
    llm = LLM(model=model_dir, max_model_len=256, enable_lora=True, max_loras=2, **kwargs)
    prompts, params, chosen = _requests(loras)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=chosen)
    if "speculative_config" in kwargs:
        # The drafting condition happened (else the comparison proves nothing about it).
        assert llm.llm_engine.engine_core.scheduler.drafter.stats.num_draft_tokens > 0
    llm.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs]


@pytest.fixture(scope="module")
def sync_uni(demo_adapters):
    model_dir, loras = demo_adapters
    return _run(model_dir, loras, async_scheduling=False)


def test_structured_requests_with_adapters_are_valid(sync_uni) -> None:
    for i in (2, 5):
        tokens, text, finish = sync_uni[i]
        assert finish == "stop", text
        value = json.loads(text)
        assert set(value) == {"id", "tag"}


def test_adapters_change_outputs(demo_adapters, sync_uni) -> None:
    model_dir, loras = demo_adapters
    base = _run(model_dir, [None, None])
    assert [r[0] for r in base] != [r[0] for r in sync_uni]


@pytest.mark.parametrize("kwargs", [
    dict(async_scheduling=True),
    dict(async_scheduling=True, distributed_executor_backend="mp"),
    # Drafts are verified by the adapted model: outputs are unchanged.
    dict(async_scheduling=True, speculative_config={"method": "ngram",
                                                    "num_speculative_tokens": 3}),
], ids=["async-uni", "async-mp", "async-ngram"])
def test_async_equals_sync(demo_adapters, sync_uni, kwargs) -> None:
    model_dir, loras = demo_adapters
    assert _run(model_dir, loras, **kwargs) == sync_uni
