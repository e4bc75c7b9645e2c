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

from vllm.attention.backends.abstract import AttentionMetadata
from vllm.model_executor.models.llama import Intermediate, LlamaForCausalLM
from vllm.model_executor.models.qwen2_5_vl import (
    MultiModalStep,
    Qwen2_5_VLForConditionalGeneration,
)
from vllm.model_executor.models.qwen3_vl_vision import Qwen3VisionTransformer


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen3-VL (dense) over flat varlen batches with a paged KV cache (one rank, or
    tensor parallel; the vision tower is replicated on every rank)."""

    qk_norm = True
    mrope_interleaved = True
    family = "Qwen3-VL"
    # transformers' default when the text config names no sections.
    default_mrope_section = (24, 20, 20)

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        """As Qwen3 (config.attention_bias on every projection), not as Qwen2."""
        return LlamaForCausalLM.attention_biases(self, config)

    def make_vision_tower(self, vision_config: Any) -> torch.nn.Module:
        """Qwen3-VL's tower, with its DeepStack mergers."""
        return Qwen3VisionTransformer(vision_config)

    def embed_image(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's rows for its placeholder tokens: [t * h * w / merge**2,
        hidden_size * (1 + number of DeepStack layers)], the main embedding first, in the
        model's dtype."""
        main, deepstack = self.visual(pixels, grid_thw)
        dtype = self.model.layers[self.model.stage.start].input_layernorm.weight.dtype
        return torch.cat([main, *deepstack], dim=1).to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate: Intermediate | None = None,
        mm: MultiModalStep | None = None,
    ) -> torch.Tensor | Intermediate:
        """As Qwen3's forward; with `mm`, the image rows' main embeddings replace their
        token embeddings, DeepStack embedding i is added to those rows after layer i, and
        the M-RoPE positions replace `positions`."""
        if mm is None or not mm.embed_rows.numel():
            return super().forward(input_ids, positions, kv_caches, attn_metadata,
                                   intermediate, mm)
        model = self.model
        assert model.embed_tokens is not None and model.norm is not None  # one stage
        width = self.hidden_size
        embeds = mm.embeds
        rows = mm.embed_rows
        if embeds.shape[1] % width:
            raise RuntimeError(f"image rows of width {embeds.shape[1]} are not a multiple of "
                               f"the hidden size {width}")
        deepstack = list(embeds[:, width:].split(width, dim=1))
        hidden = model.embed_tokens(input_ids)
        hidden = hidden.index_copy(0, rows, embeds[:, :width].to(hidden.dtype))
        residual: torch.Tensor | None = None
        for i, kv_cache in zip(model.stage, kv_caches, strict=True):
            hidden, residual = model.layers[i](mm.mrope_positions, hidden, residual, kv_cache,
                                               attn_metadata)
            if i < len(deepstack):
                # The stream is hidden + residual: adding to either adds to the stream.
                hidden = hidden.index_add(0, rows, deepstack[i].to(hidden.dtype))
        assert residual is not None
        hidden, _ = model.norm(hidden, residual)
        return hidden
