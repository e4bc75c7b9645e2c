"""Triton path of the mixture-of-experts layer: each of the two expert matmuls is one grouped
GEMM launch over all experts (triton_grouped_gemm.py; the groups are experts). Opt-in for now
(VLLM_MOE_BACKEND=triton; see fused_moe.py): it is checked in Triton's interpreter on the
CPU, not yet on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.model_executor.layers.triton_grouped_gemm import BLOCK_M, align_by_expert, grouped_gemm


def triton_fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The same result as fused_moe.fused_experts (this rank's partial sum, [T, H]), with
    each of the two expert matmuls as one grouped launch over all experts."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    pair_ids, block_expert = align_by_expert(topk_ids, w13.shape[0], BLOCK_M)
    gate_up = grouped_gemm(hidden, top_k, w13, pair_ids, block_expert, num_pairs, None)
    intermediate = w2.shape[2]
    act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down = grouped_gemm(act, 1, w2, pair_ids, block_expert, num_pairs, weights)
    # Pairs are token-major (p = t * top_k + j): each token's top_k rows are adjacent.
    return down.view(num_tokens, top_k, -1).sum(dim=1)
