"""The sparse feed-forward block shared by the mixture-of-experts families: a router, the
routed experts and (Qwen2-MoE) a gated shared expert; plus reading MoE config fields."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.distributed.parallel_state import ParallelContext
from vllm.model_executor.layers.fused_moe import QWEN_EXPERT_NAMES, ExpertNames, FusedMoE
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.models.llama import LlamaMLP


def required_int(config: Any, *names: str) -> int:
    """The first of the config fields ``names`` that is set, as an int.

    Raises ValueError naming the fields when none is set.
    """
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{' or '.join(names)}: missing from the model config")


def num_experts_of(config: Any) -> int:
    """Routed experts per MoE layer (``num_experts``, or Mixtral's ``num_local_experts``)."""
    return required_int(config, "num_experts", "num_local_experts")


def is_sparse_layer(config: Any, index: int) -> bool:
    """Whether decoder layer ``index`` of a Qwen-MoE model has experts: every
    ``decoder_sparse_step``-th layer, except those listed in ``mlp_only_layers``."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    if step < 1:
        raise ValueError(f"decoder_sparse_step: {step} must be positive")
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return index not in dense and num_experts_of(config) > 0 and (index + 1) % step == 0


def qwen_moe_mlp(
    config: Any, index: int, parallel: ParallelContext, shared_expert: bool = False
) -> SparseMoeBlock | None:
    """Decoder layer ``index``'s MLP in a Qwen-MoE model: a SparseMoeBlock (with the shared
    expert Qwen2-MoE has, if asked) on sparse layers; None (the dense MLP) elsewhere."""
    if not is_sparse_layer(config, index):
        return None
    shared = required_int(config, "shared_expert_intermediate_size") if shared_expert else None
    return SparseMoeBlock(
        config,
        required_int(config, "moe_intermediate_size"),
        bool(getattr(config, "norm_topk_prob", False)),
        parallel,
        shared_intermediate_size=shared,
    )


class SparseMoeBlock(nn.Module):
    """Router ``gate`` (replicated), routed ``experts`` and an optional shared expert
    whose output is scaled by sigmoid(``shared_expert_gate``(x)) and added to theirs."""

    def __init__(
        self,
        config: Any,
        intermediate_size: int,
        renormalize: bool,
        parallel: ParallelContext,
        expert_names: ExpertNames = QWEN_EXPERT_NAMES,
        shared_intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: {act!r} is not supported (only 'silu')")
        num_experts = num_experts_of(config)
        hidden = config.hidden_size
        self.gate = Linear(hidden, num_experts)
        self.experts = FusedMoE(
            num_experts,
            required_int(config, "num_experts_per_tok"),
            hidden,
            intermediate_size,
            renormalize,
            parallel,
            expert_names,
        )
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config, False, parallel, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [T, hidden] to [T, hidden] (all-reduced over the tensor-parallel group)."""
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out
