"""Triton path of the batched LoRA delta: the shrink (x A^T) and the expand (+= t B^T) are
each one grouped-GEMM launch over all adapter slots (the groups are slots; base-model rows
are in no group and are never touched). Opt-in (VLLM_LORA_BACKEND=triton) until it has been
checked on a GPU; checked in Triton's interpreter on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm.model_executor.layers.triton_grouped_gemm import BLOCK_M, align_by_expert, grouped_gemm


class SlotPlan:
    """The rows of one forward pass sorted by slot into blocks of BLOCK_M rows, computed
    once per forward on the device and shared by every LoRA layer."""

    def __init__(self, token_slots: torch.Tensor, num_slots: int) -> None:
        """`token_slots[i]`: row i's slot in [0, num_slots), or -1 for the base model."""
        self.num_rows = token_slots.numel()
        # Base rows go to an extra group whose blocks are then dropped (group -1).
        ids = torch.where(token_slots < 0, num_slots, token_slots).to(torch.int64)
        self.row_ids, block_slot = align_by_expert(ids, num_slots + 1, BLOCK_M)
        self.block_slot = torch.where(block_slot == num_slots, -1, block_slot)


def apply_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    plan: SlotPlan,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Adds ``(x[i] A[s]^T) B[s]^T`` to ``y[i]`` in place for each row i in slot s, and
    returns y. `reduce` sums the shrunk rows over a row-parallel layer's group."""
    if x.shape[0] != plan.num_rows:
        raise ValueError(f"the slot plan has {plan.num_rows} rows, the input {x.shape[0]}")
    shrunk = torch.zeros(x.shape[0], lora_a.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(x, 1, lora_a, plan.row_ids, plan.block_slot, plan.num_rows, out=shrunk)
    if reduce is not None:
        shrunk = reduce(shrunk)
    return grouped_gemm(shrunk, 1, lora_b, plan.row_ids, plan.block_slot, plan.num_rows, out=y)
