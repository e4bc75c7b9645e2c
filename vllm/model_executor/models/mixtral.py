"""Mixtral: Llama attention with a mixture-of-experts feed-forward block in every layer."""

from __future__ import annotations

from torch import nn

from vllm.model_executor.layers.fused_moe import MIXTRAL_EXPERT_NAMES
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.sparse_moe import SparseMoeBlock, required_int


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral causal LM: top-k experts with renormalised weights, no shared expert.

    The block is ``mlp`` here but ``block_sparse_moe`` in checkpoints, whose experts are
    ``experts.N.w1`` (gate), ``w3`` (up) and ``w2`` (down).
    """

    # The torch MoE path reads the per-expert token counts on the host (see fused_moe.py).
    supports_cuda_graphs = False

    checkpoint_renames = ((".mlp.", ".block_sparse_moe."),)

    def _make_mlp(self, index: int) -> nn.Module | None:
        """Every layer's feed-forward block is sparse."""
        config = self.config
        return SparseMoeBlock(
            config,
            required_int(config, "intermediate_size"),
            True,  # Mixtral always renormalises the top-k weights
            self.parallel,
            MIXTRAL_EXPERT_NAMES,
        )
