"""Qwen3-VL against transformers, on a tiny random checkpoint that transformers writes
(DeepStack from two vision blocks into the first two language-model layers, interleaved
M-RoPE, a learned position table resampled to each grid): placeholder counts, every step's
logits and greedy tokens on one and two images of several sizes and on text alone, with
prefill chunks that cut the images' placeholder runs; -pp 2 gives one stage's tokens, and
the synchronous step under -tp 2 with preemption gives async's on JSON-schema requests."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from tests.utils_vl import (
    QWEN3_PREPROCESSOR,
    SCHEMA,
    chat_prompt,
    greedy_agreement_with_transformers,
    hf_image_inputs,
    image,
    prompt_images,
    shared_vl_checkpoint,
)
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.config import ModelConfig
from vllm.multimodal.qwen_vl_image import (
    QwenVLImageConfig,
    num_image_tokens,
    preprocess,
)

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

# (image sizes, question): one image, two of different sizes, a larger one, none.
PROMPTS = [
    ([(30, 45)], "What is in the picture?"),
    ([(40, 56), (12, 9)], "Compare the two."),
    ([(90, 120)], "A bigger one."),
    ([], "No image at all."),
]


@pytest.fixture(scope="module")
def checkpoint():
    return shared_vl_checkpoint(family="qwen3_vl")


def test_placeholder_counts_match_transformers(checkpoint) -> None:
    path, _ = checkpoint
    config = QwenVLImageConfig.from_dir(path, ModelConfig(model=str(path)).hf_config
                                        .vision_config)
    images = [image(h, w, seed=i) for i, (h, w) in enumerate([(30, 45), (90, 120), (12, 9)])]
    want = hf_image_inputs(images, QWEN3_PREPROCESSOR)
    ours = [preprocess(im, config) for im in images]
    np.testing.assert_allclose(np.concatenate([p for p, _ in ours]),
                               want["pixel_values"].numpy(), rtol=0, atol=1e-6)
    counts = [num_image_tokens(g, config) for _, g in ours]
    assert counts == (want["image_grid_thw"].prod(-1) // 4).tolist()
    assert len(set(counts)) == len(counts)


def _engine(path, **kwargs) -> LLM:
    # Prefills of 24 tokens a step cut every image run, so each step takes a slice of an
    # image's main and DeepStack rows from the encoder cache.
    kwargs.setdefault("max_model_len", 512)
    return LLM(str(path), dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=4,
               max_num_batched_tokens=24, **kwargs)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = _engine(checkpoint[0])
    yield engine
    engine.shutdown()


def test_logits_and_greedy_tokens_match_transformers(checkpoint, llm) -> None:
    assert greedy_agreement_with_transformers(llm, checkpoint[1], PROMPTS, 16,
                                              QWEN3_PREPROCESSOR) >= 0.9


def test_pipeline_parallel_equals_one_stage(checkpoint, llm) -> None:
    """-pp 2: the first stage merges the images and adds DeepStack embedding 0, the second
    holds a vision tower too (its layer takes DeepStack embedding 1); chunked prefill cuts
    the image runs on both. The tokens are one stage's."""
    prompts = [{"prompt": chat_prompt(s, q), "multi_modal_data": {"image": prompt_images(k, s)}}
               for k, (s, q) in enumerate(PROMPTS[:2])]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = _engine(checkpoint[0], pipeline_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    finally:
        engine.shutdown()
    assert got == want


def test_sync_tensor_parallel_preempted_equals_async(checkpoint, llm) -> None:
    """JSON-schema and free requests on image prompts: the synchronous step under -tp 2
    (mp executor, each rank a whole vision tower) with a cache too small for the batch
    (requests are preempted and recomputed, images and DeepStack rows included) gives the
    async single-rank engine's tokens, and every constrained answer validates."""
    cases = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    prompts = [{"prompt": chat_prompt(s, q), "multi_modal_data": {"image": prompt_images(k, s)}}
               for k, (s, q) in enumerate(cases)]
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                                 structured_outputs=StructuredOutputsParams(
                                     json=SCHEMA, disable_any_whitespace=True))
    params = [free, constrained, free, constrained]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tokenizer = llm.get_tokenizer()
    for ids in want[1::2]:
        jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)),
                            SCHEMA)
    engine = _engine(checkpoint[0], tensor_parallel_size=2, async_scheduling=False,
                     max_model_len=160, num_gpu_blocks_override=12,
                     enable_prefix_caching=False)
    try:
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert engine.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        engine.shutdown()
    assert got == want
