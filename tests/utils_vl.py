"""A tiny random Qwen2.5-VL checkpoint written by transformers, with the demo tokenizer and
a preprocessor config, and images to feed it."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.utils_models import randomize

# The text model: Qwen2 of hidden 64 (head_dim 16: M-RoPE sections of 2 + 3 + 3 pairs).
TEXT = dict(
    vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
# The vision tower: 2 blocks (the second with full attention), patches of 4, squares of
# 2 x 2 patches, attention windows of 2 x 2 squares.
VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, window_size=16,
    fullatt_block_indexes=[1],
)
# Images are resized to between 8 x 8 and 64 x 64 pixels (1 to 64 placeholder tokens).
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "merge_size": 2,
    "temporal_patch_size": 2, "size": {"shortest_edge": 64, "longest_edge": 64 * 64},
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255, "resample": 3, "do_resize": True, "do_rescale": True,
    "do_normalize": True, "do_convert_rgb": True,
}
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def build_vl_checkpoint(path: Path, seed: int = 0):
    """Writes a random tiny Qwen2.5-VL model (float32, tied embeddings) with the demo
    tokenizer to `path`; returns the transformers model with the same weights."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from vllm.model_executor.model_loader.demo_model import build_demo_model

    config = Qwen2_5_VLConfig(text_config=dict(TEXT), vision_config=dict(VISION),
                              tie_word_embeddings=True,
                              architectures=["Qwen2_5_VLForConditionalGeneration"])
    hf = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    randomize(hf, seed)
    hf.eval()
    hf.save_pretrained(path)
    tokenizer_dir = build_demo_model("demo-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return hf


_BUILT: dict[int, tuple[Path, object]] = {}


def shared_vl_checkpoint(seed: int = 0) -> tuple[Path, object]:
    """(directory, transformers model) of a checkpoint built once per test process (each
    build writes ~40 MB; the modules that only read it share one). Removed at exit."""
    if seed not in _BUILT:
        path = Path(tempfile.mkdtemp(prefix=f"tiny-qwen2_5_vl-{seed}-"))
        atexit.register(shutil.rmtree, path, True)
        _BUILT[seed] = (path, build_vl_checkpoint(path, seed))
    return _BUILT[seed]


def image(height: int, width: int, seed: int) -> Image.Image:
    """A random RGB image."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_image_inputs(images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """transformers' own preprocessing of `images` (its PIL image processor with the
    checkpoint's settings): pixel_values and image_grid_thw."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    settings = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
    processor = Qwen2VLImageProcessorPil(**settings)
    return dict(processor(images=images, return_tensors="pt"))


def expand_placeholders(token_ids: list[int], image_token_id: int,
                        counts: list[int]) -> list[int]:
    """The processor's expansion, written out for the oracle: the i-th image token becomes
    counts[i] of them."""
    out: list[int] = []
    it = iter(counts)
    for t in token_ids:
        out.extend([t] * next(it) if t == image_token_id else [t])
    return out
