"""Qwen3-VL against transformers, on a tiny random checkpoint that transformers writes
(DeepStack from two vision blocks into the first two language-model layers, interleaved
M-RoPE, a learned position table resampled to each grid): placeholder counts, every step's
logits and greedy tokens on one and two images of several sizes and on text alone, with
prefill chunks that cut the images' placeholder runs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.utils_vl import (
    QWEN3_PREPROCESSOR,
    greedy_agreement_with_transformers,
    hf_image_inputs,
    image,
    shared_vl_checkpoint,
)
from vllm import LLM
from vllm.config import ModelConfig
from vllm.multimodal.qwen_vl_image import QwenVLImageConfig, num_image_tokens, preprocess

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


def test_logits_and_greedy_tokens_match_transformers(checkpoint) -> None:
    """Prefills of 24 tokens a step cut every image run, so each step takes a slice of an
    image's main and DeepStack rows from the encoder cache."""
    path, hf = checkpoint
    llm = LLM(str(path), dtype="float32", max_model_len=512, kv_cache_memory=64 << 20,
              max_num_seqs=4, max_num_batched_tokens=24)
    try:
        agreement = greedy_agreement_with_transformers(llm, hf, PROMPTS, 16,
                                                       QWEN3_PREPROCESSOR)
    finally:
        llm.shutdown()
    assert agreement >= 0.9
