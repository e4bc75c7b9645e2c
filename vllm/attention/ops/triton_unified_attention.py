"""One Triton paged-attention kernel for mixed prefill/decode varlen batches.

Each program takes a block of query tokens of one request together with all query heads
that share one KV head (GQA), and walks that request's paged context with an online
softmax in float32. Long decodes can instead split each context into segments handled by
separate programs whose partial results a second kernel merges (split-KV).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from vllm.attention.kv_cache_dtype import check_kv_scale, is_fp8

# Scores are kept in base-2 units so the kernel can use exp2.
_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(qsl_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    # Request i owns query blocks from qsl[i] // BLOCK_Q + i on; that start is monotone in i
    # and leaves room for ceil(query_len / BLOCK_Q) blocks, so a binary search finds it.
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _unified_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_table_ptr,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_k_blk,
    stride_k_slot,
    stride_k_head,
    stride_k_dim,
    stride_v_blk,
    stride_v_slot,
    stride_v_head,
    stride_v_dim,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    stride_bt_req,
    num_reqs,
    num_heads,
    head_size,
    qk_scale,
    v_scale,
    QPK: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SEGS: tl.constexpr,
    SPLIT: tl.constexpr,
    F32_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)

    req = _find_request(qsl_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:
        # Spare program: the grid is an upper bound on the number of query blocks.
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = local_block * BLOCK_Q + rows // QPK_PAD
    head_in_group = rows % QPK_PAD
    row_ok = (q_tok < q_len) & (head_in_group < QPK)
    head = kv_head * QPK + head_in_group
    q_pos = ctx_len + q_tok
    tok = (q_start + q_tok).to(tl.int64)

    d = tl.arange(0, HEAD_PAD)
    d_ok = d < head_size
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head
        + d[None, :] * stride_q_dim,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # Causality: no query of this block sees past its last token's position.
    last_tok = tl.minimum(q_len, (local_block + 1) * BLOCK_Q)
    kv_end = tl.minimum(seq_len, ctx_len + last_tok)
    if SPLIT:
        seg_len = tl.cdiv(tl.cdiv(seq_len, NUM_SEGS), TILE_N) * TILE_N
        kv_lo = seg * seg_len
        kv_hi = tl.minimum(kv_end, kv_lo + seg_len)
    else:
        kv_lo = 0
        kv_hi = kv_end

    # A finite floor rather than -inf: a row that has seen no visible key yet (an empty
    # segment) must not compute inf - inf = nan.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = block_table_ptr + req * stride_bt_req

    for start in range(kv_lo, kv_hi, TILE_N):
        n = start + tl.arange(0, TILE_N)
        n_ok = n < kv_hi
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % BLOCK_SIZE
        k_off = blk * stride_k_blk + slot * stride_k_slot + kv_head * stride_k_head
        v_off = blk * stride_v_blk + slot * stride_v_slot + kv_head * stride_v_head
        k = tl.load(
            k_cache_ptr + k_off[None, :] + d[:, None] * stride_k_dim,
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + v_off[:, None] + d[None, :] * stride_v_dim,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if KV_FP8:
            # Exact: every e4m3 value is representable in the query's dtype. The scales are
            # applied outside the loop (keys': in qk_scale; values': to the accumulator).
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if KV_FP8:
        acc = acc * v_scale
    if SPLIT:
        part = (tok * num_heads + head) * NUM_SEGS + seg
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :],
            acc,
            mask=row_ok[:, None],
        )
    else:
        out = acc / l_i[:, None]
        o_ptrs = (
            out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head
            + d[None, :] * stride_o_dim
        )
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    num_heads,
    head_size,
    HEAD_PAD: tl.constexpr,
    NUM_SEGS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    segs = tl.arange(0, NUM_SEGS)
    d = tl.arange(0, HEAD_PAD)
    part = (tok * num_heads + head) * NUM_SEGS + segs
    m = tl.load(part_max_ptr + part)
    l = tl.load(part_sum_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :])
    m_all = tl.max(m, 0)
    # Empty segments carry the finite floor maximum and a zero sum, so their weight is 0.
    w = tl.exp2(m - m_all)
    total = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0) / total
    o_ptrs = out_ptr + tok * stride_o_tok + head * stride_o_head + d * stride_o_dim
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=d < head_size)


def choose_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
) -> int:
    """Number of KV segments per sequence the heuristic picks (1 = no split).

    Splits only decode-only batches with long contexts whose (request, KV head) programs
    would leave most of the num_sms streaming multiprocessors idle; returns a power of two.
    """
    if max_query_len != 1 or max_seq_len < 512:
        return 1
    programs = num_reqs * num_kv_heads
    if programs >= num_sms:
        return 1
    wanted = min(triton.cdiv(2 * num_sms, programs), max_seq_len // 256, 64)
    if wanted < 2:
        return 1
    return 1 << (wanted.bit_length() - 1)


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    num_reqs: int,
    num_splits: int | None,
) -> None:
    """Raises ValueError naming the first malformed argument."""
    if not 0 <= num_tokens <= query.shape[0]:
        raise ValueError(f"num_tokens: {num_tokens} is outside [0, {query.shape[0]}]")
    if query.dim() != 3:
        raise ValueError(f"query: expected [T, num_heads, head_size], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"key_cache/value_cache: expected equal [num_blocks, block_size, kv_heads, "
            f"head_size] shapes, got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.shape[3] != query.shape[2]:
        raise ValueError(
            f"key_cache: head_size {key_cache.shape[3]} != query head_size {query.shape[2]}"
        )
    if query.shape[1] % key_cache.shape[2] != 0:
        raise ValueError(
            f"query: num_heads {query.shape[1]} is not a multiple of num_kv_heads "
            f"{key_cache.shape[2]}"
        )
    if key_cache.dtype != query.dtype and not is_fp8(key_cache.dtype):
        raise ValueError(
            f"key_cache: dtype {key_cache.dtype} is neither the query's ({query.dtype}) nor "
            "float8_e4m3fn"
        )
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache: dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}"
        )
    if out.shape != query.shape:
        raise ValueError(f"out: shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    if num_reqs < 0 or query_start_loc.shape[0] < num_reqs + 1 or seq_lens.shape[0] < num_reqs:
        raise ValueError(
            f"num_reqs: {num_reqs} does not fit query_start_loc {tuple(query_start_loc.shape)} "
            f"and seq_lens {tuple(seq_lens.shape)}"
        )
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table: expected [>= num_reqs, max_blocks], got {tuple(block_table.shape)}"
        )
    if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
        raise ValueError(f"num_splits: must be a power of two >= 1, got {num_splits}")


def _partials(
    query: torch.Tensor, out: torch.Tensor, num_tokens: int, num_splits: int, head_pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-segment accumulator, running max and sum that split-KV programs write for the
    merge kernel (with one segment the kernel ignores them, so `out` stands in)."""
    if num_splits == 1:
        return out, out, out
    num_heads = query.shape[1]
    part_acc = torch.empty(
        (num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=query.device
    )
    part_max = torch.empty(
        (num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
    )
    return part_acc, part_max, torch.empty_like(part_max)


def _tiles(query: torch.Tensor, key_cache: torch.Tensor, max_query_len: int) -> dict[str, Any]:
    """The attention kernel's tile shapes and dot precision for this batch, by their
    constexpr names."""
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    qpk = num_heads // num_kv_heads
    qpk_pad = triton.next_power_of_2(qpk)
    head_pad = max(16, triton.next_power_of_2(head_size))
    # Decodes get the smallest tile tl.dot allows; prefills share K/V loads across more rows.
    block_m = max(16 if max_query_len == 1 else 64, qpk_pad)
    # float32 inputs need exact (not tf32) dots; the interpreter also multiplies bfloat16
    # operands wrongly, so there they are widened first.
    interpreted = isinstance(_unified_attention_kernel, InterpretedFunction)
    f32_dot = query.dtype == torch.float32 or (interpreted and query.dtype == torch.bfloat16)
    return dict(QPK=qpk, QPK_PAD=qpk_pad, BLOCK_M=block_m, BLOCK_Q=block_m // qpk_pad,
                HEAD_PAD=head_pad, TILE_N=64 if head_pad <= 128 else 32, BLOCK_SIZE=block_size,
                F32_DOT=f32_dot)


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    num_sms: int = 132,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes causal paged attention for a flat varlen batch into out.

    query/out: [T, num_heads, head_size]; key_cache/value_cache: [num_blocks, block_size,
    num_kv_heads, head_size]; query_start_loc [>= num_reqs + 1] int32 (its last used entry
    must be num_tokens), seq_lens [num_reqs] int32 (context incl. the new tokens, which are
    its last ones), block_table [num_reqs, max_blocks] int32. num_tokens, num_reqs,
    max_query_len and max_seq_len are host ints (no device sync is made). num_splits: None
    lets choose_num_splits decide (num_sms sizes that choice), 1 forbids splitting, a power of
    two > 1 forces that many KV segments per sequence. Rows of out past num_tokens are left
    untouched. The caches hold the query's dtype, or float8_e4m3fn values that are
    dequantized on read with k_scale and v_scale (per-tensor; unused for other caches).
    Side effect: out is overwritten. Raises ValueError on malformed arguments.
    """
    _check_inputs(
        query, key_cache, value_cache, out, query_start_loc, seq_lens, block_table,
        num_tokens, num_reqs, num_splits,
    )
    kv_fp8 = is_fp8(key_cache.dtype)
    if kv_fp8:
        # Scores are linear in the keys: their scale joins the softmax scale.
        scale *= check_kv_scale(k_scale, "k_scale")
        v_scale = check_kv_scale(v_scale, "v_scale")
    if num_tokens == 0 or num_reqs == 0:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    tiles = _tiles(query, key_cache, max_query_len)
    if num_splits is None:
        num_splits = choose_num_splits(num_reqs, num_kv_heads, max_query_len, max_seq_len, num_sms)
    num_q_blocks = num_tokens // tiles["BLOCK_Q"] + num_reqs
    part_acc, part_max, part_sum = _partials(query, out, num_tokens, num_splits,
                                             tiles["HEAD_PAD"])
    _unified_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        query, key_cache, value_cache, out, part_acc, part_max, part_sum,
        query_start_loc, seq_lens, block_table,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
        block_table.stride(0), num_reqs, num_heads, head_size, scale * _LOG2E,
        float(v_scale),
        **tiles,
        NUM_SEGS=num_splits,
        SPLIT=num_splits > 1,
        KV_FP8=kv_fp8,
        # float32 tiles are twice as large; fewer stages keep them within shared memory.
        num_stages=2 if query.element_size() == 4 else 3,
    )
    if num_splits > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, *out.stride(), num_heads, head_size,
            HEAD_PAD=tiles["HEAD_PAD"], NUM_SEGS=num_splits,
        )
