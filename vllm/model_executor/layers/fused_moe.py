"""Mixture-of-experts feed-forward layer (torch path): routing, grouped expert matmuls and
the weighted combine, with every expert's intermediate dimension split among the
tensor-parallel ranks.

Routing picks the ``top_k`` experts of each token from a softmax over the router logits.
The token-expert pairs are then sorted by expert once per layer, so each expert runs one
matmul over a contiguous run of the sorted pairs; the weighted results go back to their
tokens with one index_add. VLLM_MOE_BACKEND=triton swaps the expert loop for a Triton
grouped GEMM (fused_moe_triton.py; opt-in until it has been checked on a GPU).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.parallel_state import ParallelContext, shard_range
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor, check_shape

# Per-expert checkpoint projections in the order gate, up, down.
ExpertNames = tuple[str, str, str]
QWEN_EXPERT_NAMES: ExpertNames = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES: ExpertNames = ("w1", "w3", "w2")
MOE_BACKENDS = ("torch", "triton")


def moe_backend() -> str:
    """The expert-matmul implementation VLLM_MOE_BACKEND names: 'torch' (default) or
    'triton'. Raises ValueError naming the variable for any other value."""
    backend = os.environ.get("VLLM_MOE_BACKEND", "torch").strip().lower() or "torch"
    if backend not in MOE_BACKENDS:
        raise ValueError(f"VLLM_MOE_BACKEND: {backend!r} is not one of {', '.join(MOE_BACKENDS)}")
    return backend


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights [T, top_k] float32, expert ids [T, top_k] int64) of each token.

    The weights are the softmax probabilities of the chosen experts, divided by their sum
    when ``renormalize`` is set. The softmax runs in float32 whatever the logits' dtype, so
    low-precision models route like their reference implementations.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Maps tokens [T, H] to sum_k weight[t, k] * expert_{id[t, k]}(hidden[t]), [T, H].

    Expert e computes w2[e] @ (silu(gate) * up) with [gate; up] = w13[e] @ x, where w13 is
    [E, 2 * I, H] (gate rows then up rows) and w2 is [E, H, I]. Under tensor parallelism I
    is this rank's slice and the result is this rank's partial sum (not yet all-reduced).
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)
    if num_tokens == 0:
        return out
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        # The per-expert token counts below are read on the host, which a graph cannot hold.
        raise RuntimeError("the torch MoE path cannot be captured in a CUDA graph")
    flat_ids = topk_ids.reshape(-1)
    # One stable sort groups the token-expert pairs by expert; pair p belongs to token
    # p // top_k, since flat_ids lists each token's top_k choices together.
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # one host sync
    x = hidden.index_select(0, token_of)
    y = torch.empty_like(x)
    intermediate = w2.shape[2]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate_up = F.linear(x[rows], w13[expert])
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y[rows] = F.linear(act, w2[expert])
        start += count
    y.mul_(topk_weights.reshape(-1)[order].to(y.dtype).unsqueeze(1))
    return out.index_add_(0, token_of, y)


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer, their weights stacked: ``w13_weight``
    [E, 2 * I_local, H] and ``w2_weight`` [E, H, I_local].

    Each expert's intermediate dimension I is split evenly among the tensor-parallel ranks
    (w13 by rows, like a column-parallel layer; w2 by columns, like a row-parallel one);
    forward all-reduces the partial outputs, so every rank returns the full result.
    Checkpoints hold one tensor per expert and projection, ``{e}.{name}.weight`` under this
    module, with the names given by ``expert_names`` (gate, up, down).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        parallel: ParallelContext | None = None,
        expert_names: ExpertNames = QWEN_EXPERT_NAMES,
    ) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts: {num_experts} must be positive")
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok: {top_k} must be between 1 and num_experts ({num_experts})"
            )
        self.parallel = parallel or ParallelContext.single()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.expert_names = expert_names
        self.backend = moe_backend()
        self.shard_start, local = shard_range(
            intermediate_size, self.parallel.tp_size, self.parallel.tp_rank
        )
        self.local_intermediate = local
        # Uninitialized: the loader overwrites every parameter.
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, local), requires_grad=False
        )

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Maps tokens [T, H] and router logits [T, E] to the experts' combined output [T, H].

        Side effect (tp > 1): an all-reduce over the tensor-parallel group.
        """
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        experts = fused_experts
        if self.backend == "triton":
            # Imported only when chosen: triton is optional on a CPU-only install.
            from vllm.model_executor.layers.fused_moe_triton import triton_fused_experts

            experts = triton_fused_experts
        out = experts(hidden, self.w13_weight, self.w2_weight, weights, ids)
        return self.parallel.all_reduce(out)

    def checkpoint_parts(self, param_name: str) -> list[tuple[str, int]]:
        """(checkpoint name under this module, part) of every tensor that fills a parameter.

        Part 2e / 2e + 1 of ``w13_weight`` is expert e's gate / up projection; part e of
        ``w2_weight`` is expert e's down projection.
        """
        gate, up, down = self.expert_names
        if param_name == "w13_weight":
            return [
                (f"{e}.{name}.weight", 2 * e + i)
                for e in range(self.num_experts)
                for i, name in enumerate((gate, up))
            ]
        if param_name == "w2_weight":
            return [(f"{e}.{down}.weight", e) for e in range(self.num_experts)]
        raise ValueError(f"this layer has no {param_name!r} parameter")

    def load_weight(
        self, param_name: str, tensor: CheckpointTensor, part: int | None = None
    ) -> None:
        """Copies this rank's slice of one expert's full checkpoint projection into the
        stacked parameter (see checkpoint_parts for what ``part`` means).

        Raises ValueError for a missing or out-of-range part, an unknown parameter or a
        checkpoint tensor whose full shape is wrong.
        """
        local, start = self.local_intermediate, self.shard_start
        if param_name == "w13_weight":
            if part is None or not 0 <= part < 2 * self.num_experts:
                raise ValueError(f"w13_weight has no part {part}")
            expert, half = divmod(part, 2)
            check_shape(tensor, (self.intermediate_size, self.hidden_size))
            with torch.no_grad():
                target = self.w13_weight.data[expert].narrow(0, half * local, local)
                target.copy_(tensor.read_range(0, start, local))
        elif param_name == "w2_weight":
            if part is None or not 0 <= part < self.num_experts:
                raise ValueError(f"w2_weight has no part {part}")
            check_shape(tensor, (self.hidden_size, self.intermediate_size))
            with torch.no_grad():
                self.w2_weight.data[part].copy_(tensor.read_range(1, start, local))
        else:
            raise ValueError(f"this layer has no {param_name!r} parameter")

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size} (from {self.shard_start}: "
            f"{self.local_intermediate}), renormalize={self.renormalize}, "
            f"backend={self.backend}"
        )
