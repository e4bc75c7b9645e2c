"""Qwen3-MoE: Qwen3 attention (per-head q/k norm) with mixture-of-experts feed-forward
blocks; layers listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` stay dense."""

from __future__ import annotations

from torch import nn

from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.sparse_moe import qwen_moe_mlp


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE causal LM: top-k routed experts (weights renormalised when
    ``norm_topk_prob``), no shared expert."""

    # The torch MoE path reads the per-expert token counts on the host (see fused_moe.py).
    supports_cuda_graphs = False

    def _make_mlp(self, index: int) -> nn.Module | None:
        """A SparseMoeBlock on sparse layers; None (the dense MLP) elsewhere."""
        return qwen_moe_mlp(self.config, index, self.parallel)
