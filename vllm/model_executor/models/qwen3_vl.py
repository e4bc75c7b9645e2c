"""Qwen3-VL: the Qwen3 language model (per-head q/k norms) with interleaved M-RoPE, fed
image embeddings from its vision tower (qwen3_vl_vision.py) at the image placeholder
positions, plus DeepStack: the tower's earlier blocks give one more embedding per
placeholder for each of the first language-model layers, added to the residual stream at
those positions after the layer.

Everything else (the runner's MultiModalStep, the encoder cache, checkpoint layouts, text-
only steps) is Qwen2.5-VL's (qwen2_5_vl.py). The encoder cache keeps one row per
placeholder token; for Qwen3-VL that row is the main embedding followed by the DeepStack
ones, so a chunked prefill slices all of them alike.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from vllm.model_executor.models.qwen3_vl_vision import Qwen3VisionTransformer


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen3-VL (dense) over flat varlen batches with a paged KV cache (tensor and
    pipeline parallel as Qwen2.5-VL)."""

    qk_norm = True
    mrope_interleaved = True
    family = "Qwen3-VL"
    # transformers' default when the text config names no sections.
    default_mrope_section = (24, 20, 20)

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        """As Qwen3 (config.attention_bias on every projection), not as Qwen2."""
        return LlamaForCausalLM.attention_biases(self, config)

    @staticmethod
    def num_deepstack_layers(vision_config: Any) -> int:
        """One decoder layer per DeepStack merger, from the first."""
        return len(vision_config.deepstack_visual_indexes or ())

    def make_vision_tower(self, vision_config: Any) -> torch.nn.Module:
        """Qwen3-VL's tower, with its DeepStack mergers."""
        return Qwen3VisionTransformer(vision_config)

    def embed_image(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's rows for its placeholder tokens: [t * h * w / merge**2,
        hidden_size * (1 + number of DeepStack layers)], the main embedding first, in the
        model's dtype (the forward, Qwen2.5-VL's, adds DeepStack embedding i to the image
        rows after decoder layer i)."""
        if self.visual is None:
            raise RuntimeError("this pipeline stage has no vision tower")
        main, deepstack = self.visual(pixels, grid_thw)
        dtype = self.model.layers[self.model.stage.start].input_layernorm.weight.dtype
        return torch.cat([main, *deepstack], dim=1).to(dtype)
