"""Qwen2-MoE: Qwen2 attention (biased q/k/v) with mixture-of-experts feed-forward blocks
that add a sigmoid-gated shared expert to the routed ones."""

from __future__ import annotations

from typing import Any

from torch import nn

from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.sparse_moe import qwen_moe_mlp


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2-MoE causal LM: routed experts (renormalised when ``norm_topk_prob``) plus a
    shared expert of ``shared_expert_intermediate_size``; dense layers as in Qwen3-MoE."""

    # The torch MoE path reads the per-expert token counts on the host (see fused_moe.py).
    supports_cuda_graphs = False

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        """q/k/v biased unless ``qkv_bias`` is false; never an output-projection bias."""
        return bool(getattr(config, "qkv_bias", True)), False

    def _make_mlp(self, index: int) -> nn.Module | None:
        """A SparseMoeBlock with a shared expert on sparse layers; None (dense) elsewhere."""
        return qwen_moe_mlp(self.config, index, self.parallel, shared_expert=True)
