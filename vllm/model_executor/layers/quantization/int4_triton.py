"""Triton matmul over 4-bit weights packed along the input dimension, dequantizing each
tile in registers (compressed-tensors W4A16 and GPTQ; AWQ packs along the output).

Weight element (n, k) is nibble k % 8 of word ``w[n, k // 8]`` (strides given, so GPTQ's
[in / 8, out] and compressed-tensors' [out, in / 8] are the same kernel). Its group is
``g_idx[k]`` (GPTQ) or ``k // group_size``; its value is ``(nibble - zero) * scale[n, g]``
where zero is a nibble of ``zeros`` packed along the output (plus ``zero_bias``) or the
constant ``zero_bias`` when there are no zero points. Checked in Triton's interpreter on
the CPU; on CUDA the 4-bit methods use it (the CPU dequantizes in torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# tl.dot needs every block dimension to be at least 16.
BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _int4_matmul_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, y_ptr,
    m_size, n_size, k_size, group_size, zero_bias,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg,
    stride_zn, stride_zg, stride_ym, stride_yn,
    HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = offs_m < m_size
    n_mask = offs_n < n_size
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_mask = k < k_size
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        tile_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k // 8)[:, None] * stride_wk,
                        mask=tile_mask, other=0)
        nibble = (words >> ((k % 8) * 4).to(tl.int32)[:, None]) & 0xF
        if HAS_G_IDX:
            group = tl.load(g_ptr + k, mask=k_mask, other=0).to(tl.int64)
        else:
            group = k // group_size
        scale = tl.load(s_ptr + offs_n[None, :] * stride_sn + group[:, None] * stride_sg,
                        mask=tile_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zwords = tl.load(z_ptr + (offs_n // 8)[None, :] * stride_zn
                             + group[:, None] * stride_zg, mask=tile_mask, other=0)
            zero = ((zwords >> ((offs_n % 8) * 4).to(tl.int32)[None, :]) & 0xF) + zero_bias
        else:
            zero = zero_bias
        w = (nibble - zero).to(tl.float32) * scale  # [BLOCK_K, BLOCK_N]
        # IEEE float32 products (no TF32), so a float32 model matches the torch path.
        acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int4_matmul(
    x: torch.Tensor,
    words: torch.Tensor,
    word_strides: tuple[int, int],
    scales: torch.Tensor,
    scale_strides: tuple[int, int],
    out_size: int,
    zero_bias: int,
    zeros: torch.Tensor | None = None,
    zero_strides: tuple[int, int] = (0, 0),
    g_idx: torch.Tensor | None = None,
    group_size: int = 0,
) -> torch.Tensor:
    """``x W^T`` for x [..., in] and a 4-bit W [out, in] described as in the module
    docstring; strides are (per output row, per input word / group) in elements."""
    rows = x.reshape(-1, x.shape[-1])
    m_size, k_size = rows.shape
    y = torch.empty(m_size, out_size, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m_size, BLOCK_M), triton.cdiv(out_size, BLOCK_N))
    _int4_matmul_kernel[grid](
        rows, words, scales,
        zeros if zeros is not None else words,  # unread without HAS_ZEROS
        g_idx if g_idx is not None else words,  # unread without HAS_G_IDX
        y, m_size, out_size, k_size, max(group_size, 1), zero_bias,
        rows.stride(0), rows.stride(1), *word_strides, *scale_strides, *zero_strides,
        y.stride(0), y.stride(1),
        HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return y.reshape(*x.shape[:-1], out_size)
