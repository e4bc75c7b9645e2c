"""Triton kernel that writes new keys and values into a paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.attention.kv_cache_dtype import FP8_MAX, check_kv_scale, is_fp8


# Adding then subtracting 1.5 * 2**14 rounds a float32 below 2**13 in magnitude to a multiple
# of 2**-9, the spacing of e4m3's subnormals (ties to even, as every float32 add rounds).
_SUBNORMAL_ROUNDER = 24576.0
_MIN_NORMAL = 2.0**-6


@triton.jit
def _round_to_e4m3(x, SUBNORMAL_ROUNDER: tl.constexpr, MIN_NORMAL: tl.constexpr):
    # Rounds float32 values within ±448 to the nearest e4m3 value (ties to even), so the
    # final conversion is exact. Converting directly would do the same on a GPU, but
    # Triton's CPU interpreter loses the carry when rounding up crosses a power of two
    # (127.99 became 64), and the interpreter is what tests run.
    bits = x.to(tl.int32, bitcast=True)
    # Keep 3 of float32's 23 mantissa bits: add just under half of the dropped part, plus
    # the lowest kept bit (ties to even), and let a carry run into the exponent.
    lowest_kept = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lowest_kept) & -0x100000).to(tl.float32, bitcast=True)
    # Rounded as a magnitude, then given x's sign back (a tiny negative stays -0.0).
    magnitude = (tl.abs(x) + SUBNORMAL_ROUNDER) - SUBNORMAL_ROUNDER
    sign = bits & -0x80000000
    subnormal = (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < MIN_NORMAL, subnormal, normal)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_kc_dim,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    stride_vc_dim,
    num_kv_heads,
    head_size,
    k_scale,
    v_scale,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    FP8: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    SUBNORMAL_ROUNDER: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        # Padding token: its K/V must not land anywhere in the cache.
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_size)

    k = tl.load(
        key_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :] * stride_k_dim,
        mask=mask,
    )
    v = tl.load(
        value_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :] * stride_v_dim,
        mask=mask,
    )
    kc = (
        key_cache_ptr
        + blk * stride_kc_blk
        + off * stride_kc_slot
        + h[:, None] * stride_kc_head
        + d[None, :] * stride_kc_dim
    )
    vc = (
        value_cache_ptr
        + blk * stride_vc_blk
        + off * stride_vc_slot
        + h[:, None] * stride_vc_head
        + d[None, :] * stride_vc_dim
    )
    if FP8:
        # Saturate rather than let an outlier become NaN in the cache.
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_LIMIT, FP8_LIMIT)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_LIMIT, FP8_LIMIT)
        k = _round_to_e4m3(k, SUBNORMAL_ROUNDER, MIN_NORMAL)
        v = _round_to_e4m3(v, SUBNORMAL_ROUNDER, MIN_NORMAL)
    tl.store(kc, k.to(kc.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes key[t] and value[t] into kv_cache at cache slot slot_mapping[t].

    key, value: [T, num_kv_heads, head_size]; kv_cache: [2, num_blocks, block_size,
    num_kv_heads, head_size] (index 0 keys, 1 values); slot_mapping: [>= T] integer slots
    (block * block_size + offset), -1 meaning "skip this token". Only the first num_tokens
    tokens are written (default: all T). Values are cast to the cache dtype; a float8_e4m3fn
    cache gets key / k_scale and value / v_scale saturated to the e4m3 range.
    Side effect: kv_cache is modified in place. Raises ValueError on mismatched shapes or a
    scale that is not finite and positive.
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key/value: expected equal [T, kv_heads, head_size] shapes, got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache: expected [2, num_blocks, block_size, kv_heads, head_size], got "
            f"{tuple(kv_cache.shape)}"
        )
    if tuple(kv_cache.shape[3:]) != tuple(key.shape[1:]):
        raise ValueError(
            f"kv_cache: heads/head_size {tuple(kv_cache.shape[3:])} do not match key "
            f"{tuple(key.shape[1:])}"
        )
    n = key.shape[0] if num_tokens is None else num_tokens
    if n < 0 or n > key.shape[0] or slot_mapping.shape[0] < n:
        raise ValueError(
            f"num_tokens: {n} is out of range for {key.shape[0]} keys and "
            f"{slot_mapping.shape[0]} slots"
        )
    check_kv_scale(k_scale, "k_scale")
    check_kv_scale(v_scale, "v_scale")
    if n == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    _reshape_and_cache_kernel[(n,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        num_kv_heads,
        head_size,
        float(k_scale),
        float(v_scale),
        BLOCK_SIZE=kv_cache.shape[2],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
        FP8=is_fp8(kv_cache.dtype),
        FP8_LIMIT=FP8_MAX,
        SUBNORMAL_ROUNDER=_SUBNORMAL_ROUNDER,
        MIN_NORMAL=_MIN_NORMAL,
    )
