"""Tiny random Qwen2.5-VL and Qwen3-VL checkpoints written by transformers, with the demo
tokenizer and a preprocessor config, and images to feed them."""

from __future__ import annotations

import atexit
import copy
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
# What the image tests ask for under a JSON schema.
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "count"],
    "additionalProperties": False,
}
# <|image_pad|> in the demo tokenizer (Qwen's id).
IMAGE_TOKEN_ID = 151655

# Qwen3-VL: a Qwen3 text model (explicit head_dim, q/k norms, interleaved M-RoPE) and a
# tower with a 4 x 4 learned position table and DeepStack from both blocks (the first two
# language-model layers get them).
QWEN3_TEXT = {
    **TEXT, "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "mrope_section": [2, 3, 3], "mrope_interleaved": True},
}
QWEN3_VISION = {
    "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
    "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1],
}
# Qwen3-VL's processor statistics are 0.5 (its own preprocessor_config.json).
QWEN3_PREPROCESSOR = {**PREPROCESSOR, "image_mean": [0.5, 0.5, 0.5],
                      "image_std": [0.5, 0.5, 0.5]}


def build_vl_checkpoint(path: Path, seed: int = 0, family: str = "qwen2_5_vl"):
    """Writes a random tiny Qwen2.5-VL (or, with family "qwen3_vl", Qwen3-VL) model
    (float32, tied embeddings) with the demo tokenizer to `path`; returns the transformers
    model with the same weights."""
    import transformers

    from vllm.model_executor.model_loader.demo_model import build_demo_model

    if family == "qwen3_vl":
        arch, text, vision, preprocessor = ("Qwen3VL", QWEN3_TEXT, QWEN3_VISION,
                                            QWEN3_PREPROCESSOR)
    else:
        arch, text, vision, preprocessor = "Qwen2_5_VL", TEXT, VISION, PREPROCESSOR
    config = getattr(transformers, f"{arch}Config")(
        text_config=dict(text), vision_config=dict(vision), tie_word_embeddings=True,
        architectures=[f"{arch}ForConditionalGeneration"])
    hf = getattr(transformers, f"{arch}ForConditionalGeneration")(config).to(torch.float32)
    randomize(hf, seed)
    hf.eval()
    hf.save_pretrained(path)
    tokenizer_dir = build_demo_model("demo-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return hf


_BUILT: dict[tuple[int, str], tuple[Path, object]] = {}


def shared_vl_checkpoint(seed: int = 0, family: str = "qwen2_5_vl") -> tuple[Path, object]:
    """(directory, transformers model) of a checkpoint built once per test process (each
    build writes ~40 MB; the modules that only read it share one). Removed at exit."""
    key = (seed, family)
    if key not in _BUILT:
        path = Path(tempfile.mkdtemp(prefix=f"tiny-{family}-{seed}-"))
        atexit.register(shutil.rmtree, path, True)
        _BUILT[key] = (path, build_vl_checkpoint(path, seed, family))
    return _BUILT[key]


def image(height: int, width: int, seed: int) -> Image.Image:
    """A random RGB image."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_image_inputs(images: list[Image.Image],
                    preprocessor: dict | None = None) -> dict[str, torch.Tensor]:
    """transformers' own preprocessing of `images` (its PIL image processor with the
    checkpoint's settings, PREPROCESSOR unless given): pixel_values and image_grid_thw."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    # A deep copy: the processor writes min/max_pixels into the size dict it is given.
    settings = {k: copy.deepcopy(v) for k, v in (preprocessor or PREPROCESSOR).items()
                if k != "image_processor_type"}
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


def chat_prompt(sizes: list[tuple[int, int]], question: str) -> str:
    """A rendered one-turn chat prompt with one placeholder per image size, then the
    question."""
    images = "".join(f"Picture {i}: {PLACEHOLDER}\n" for i in range(len(sizes)))
    return f"<|im_start|>user\n{images}{question}<|im_end|>\n<|im_start|>assistant\n"


def prompt_images(k: int, sizes: list[tuple[int, int]]) -> list[Image.Image]:
    """The random images of prompt number `k` (seeded by k and their place)."""
    return [image(h, w, seed=100 * k + i) for i, (h, w) in enumerate(sizes)]


def hf_prompt_inputs(tokenizer, k: int, sizes: list[tuple[int, int]], question: str,
                     preprocessor: dict | None = None) -> dict[str, torch.Tensor]:
    """transformers' input for chat_prompt(sizes, question) with prompt_images(k, sizes):
    its processor's pixels and the ids with each placeholder expanded (merge 2 x 2)."""
    ids = tokenizer.encode(chat_prompt(sizes, question), add_special_tokens=False)
    if not sizes:
        return {"input_ids": torch.tensor([ids])}
    pix = hf_image_inputs(prompt_images(k, sizes), preprocessor)
    counts = (pix["image_grid_thw"].prod(-1) // 4).tolist()
    ids = expand_placeholders(ids, IMAGE_TOKEN_ID, counts)
    return {"input_ids": torch.tensor([ids]), "pixel_values": pix["pixel_values"],
            "image_grid_thw": pix["image_grid_thw"],
            "mm_token_type_ids": (torch.tensor([ids]) == IMAGE_TOKEN_ID).int()}


def greedy_agreement_with_transformers(llm, hf, cases: list[tuple[list[tuple[int, int]], str]],
                                       max_tokens: int, preprocessor: dict | None = None
                                       ) -> float:
    """Runs each case (image sizes, question) greedily through `llm` and checks it against
    `hf`, transformers' model of the same checkpoint: the prompt ids equal the processor's
    expansion, and every step's logits are within 1e-4 of transformers' (teacher-forced on
    the engine's tokens). Returns the share of generated tokens equal to transformers' own
    greedy generation."""
    from tests.utils_models import capture_logits
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt": chat_prompt(s, q), "multi_modal_data": {"image": prompt_images(k, s)}}
               if s else chat_prompt(s, q) for k, (s, q) in enumerate(cases)]
    captured = capture_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True), use_tqdm=False)
    agree = 0
    for k, ((sizes, question), out) in enumerate(zip(cases, outs, strict=True)):
        inputs = hf_prompt_inputs(tokenizer, k, sizes, question, preprocessor)
        prompt_ids = inputs["input_ids"][0].tolist()
        assert out.prompt_token_ids == prompt_ids, (k, sizes)  # the processor's expansion
        got_ids = list(out.outputs[0].token_ids)
        with torch.inference_mode():
            # Teacher-forced on the engine's tokens: every step's logits at once.
            forced = dict(inputs, input_ids=torch.tensor([prompt_ids + got_ids]))
            if sizes:
                forced["mm_token_type_ids"] = (forced["input_ids"] == IMAGE_TOKEN_ID).int()
            want = hf(**forced).logits[0, len(prompt_ids) - 1:-1]
            greedy = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                                 min_new_tokens=max_tokens)[0, len(prompt_ids):].tolist()
        got = torch.stack(captured[out.request_id])
        assert want.std() > 0.5
        assert (got - want).abs().max().item() < 1e-4, (k, sizes)
        agree += sum(a == b for a, b in zip(got_ids, greedy))
    return agree / (max_tokens * len(cases))
