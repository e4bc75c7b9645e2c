"""Triton grouped GEMM: rows of one matrix multiplied by the weight of their group (an
expert of a mixture-of-experts layer, a LoRA slot), every group in one launch.

The rows are sorted by group and each group's run is padded to a multiple of the row block,
so every row block of the launch belongs to one group (``align_by_expert``). All shapes
depend only on the number of rows, never on how they are grouped, and nothing is read back
to the host (a prerequisite for CUDA-graph capture, not yet tried). Checked in Triton's
interpreter on the CPU, not yet on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# tl.dot needs every block dimension to be at least 16.
BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups the rows p of ``topk_ids.reshape(-1)`` (MoE: pairs p = t * top_k + j) by their
    group id (the expert; a LoRA slot), each group's run padded to block_m rows.

    Returns (row ids [num_blocks * block_m], group of each block [num_blocks]).
    num_blocks is the worst case over routings, so the shapes depend on topk_ids' shape
    only; padding rows hold the row count (one past the last row), unused blocks group -1.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    # scatter_add rather than bincount, which reads the largest id back to the host on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    # Position of each sorted pair: its expert's padded start plus its rank within the expert.
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - run_start[expert_sorted]
    dest = (padded_end - padded)[expert_sorted] + rank
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64,
                          device=flat.device)
    pair_ids[dest] = order
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pair_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    scale_ptr,
    num_pairs,
    n_size,
    k_size,
    a_row_div,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    HAS_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return  # a block past the last expert's padded run
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + offs_m).to(tl.int64)
    row_mask = pair < num_pairs
    # Row of A: the pair's token (a_row_div = top_k) or the pair itself (a_row_div = 1).
    a_row = pair // a_row_div
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < n_size
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_size
        a = tl.load(
            a_ptr + a_row[:, None] * stride_am + k[None, :] * stride_ak,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + k[:, None] * stride_wk,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        # IEEE float32 products (no TF32), so a float32 model matches the torch path.
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + pair, mask=row_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = row_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        # Each row belongs to one block of one launch, so no other program writes it.
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def grouped_gemm(
    a: torch.Tensor,
    a_row_div: int,
    w: torch.Tensor,
    pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """c[p] = scale[p] * (a[p // a_row_div] @ w[group(p)]^T) for every row p of a block with a
    group, [P, N]. With `out`, the products are added to it in place (and it is returned);
    rows in no group's block are then left as they were, else they are uninitialized."""
    n_size, k_size = w.shape[1], w.shape[2]
    c = out if out is not None else torch.empty(num_pairs, n_size, dtype=a.dtype,
                                                device=a.device)
    grid = (block_expert.numel(), triton.cdiv(n_size, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, c, pair_ids, block_expert,
        scale if scale is not None else c,  # unread without HAS_SCALE
        num_pairs, n_size, k_size, a_row_div,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        c.stride(0), c.stride(1),
        HAS_SCALE=scale is not None,
        ACCUMULATE=out is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return c
