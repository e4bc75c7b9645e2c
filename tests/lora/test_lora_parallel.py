"""Oracle: adapters under tensor and pipeline parallelism agree with one rank.

Each rank keeps its shard of every adapter (B's output rows in column-parallel layers, A's
input columns in row-parallel ones, whose partial products are summed over the group). A
random Qwen2 checkpoint (biased q/k/v, untied head) runs a batch mixing two adapters and the
base model; outputs must agree with -tp 1 as tests/distributed/test_tensor_parallel.py
defines agreement (two ranks reduce in another order).
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import HF_PROMPTS
from tests.distributed.test_tensor_parallel import assert_agree
from tests.lora.utils import ALL_TARGETS, build_adapter
from tests.utils_models import build_checkpoint
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader.demo_model import build_demo_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp")
    hf = build_checkpoint("qwen2", root / "model", seed=3)
    build_adapter(hf, root / "one", seed=1, targets=ALL_TARGETS, r=4)
    build_adapter(hf, root / "two", seed=2, targets=["k_proj", "o_proj", "down_proj"], r=2)
    loras = [LoRARequest("one", 1, str(root / "one")), None,
             LoRARequest("two", 2, str(root / "two"))]
    return root / "model", [loras[i % 3] for i in range(len(HF_PROMPTS))]


def _outputs(setup, **kwargs) -> list:
    model, loras = setup
    llm = LLM(str(model), tokenizer=str(build_demo_model("demo-tiny")), dtype="float32",
              max_model_len=128, enable_lora=True, max_loras=2, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in HF_PROMPTS], params,
                            use_tqdm=False, lora_request=loras)
    finally:
        llm.shutdown()
    return [o.outputs[0] for o in outs]


pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


@pytest.fixture(scope="module")
def one_rank(setup, one_thread_per_rank) -> list:
    return _outputs(setup)


def test_adapters_matter(setup, one_rank) -> None:
    model, _ = setup
    base = _outputs((model, [None] * len(HF_PROMPTS)))
    differ = [a.token_ids != b.token_ids for a, b in zip(base, one_rank)]
    assert not any(differ[1::3]) and all(differ[0::3]) and all(differ[2::3])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=2),
                                    dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_parallel_agrees_with_one_rank(setup, one_rank, kwargs) -> None:
    assert_agree(_outputs(setup, **kwargs), one_rank)
