"""Exact paged attention in plain torch: the CPU backend and the reference for the others."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata
from vllm.attention.kv_cache_dtype import is_fp8, quantize_fp8


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Stores key/value [N, Hkv, D] at the flat cache slots given per token.

    An FP8 cache gets key / k_scale and value / v_scale saturated to the e4m3 range; any
    other cache gets them cast to its dtype (the scales are then unused).
    Side effect: modifies kv_cache in place; tokens whose slot is -1 are not written.
    """
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    if is_fp8(kv_cache.dtype):
        # index_copy_ has no float8 kernel: the quantized bytes are copied as uint8.
        cache = kv_cache.view(torch.uint8)
        key = quantize_fp8(key, k_scale).view(torch.uint8)
        value = quantize_fp8(value, v_scale).view(torch.uint8)
    else:
        cache = kv_cache
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    num_kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
    cache[0].view(-1, num_kv_heads, head_size).index_copy_(0, slots, key)
    cache[1].view(-1, num_kv_heads, head_size).index_copy_(0, slots, value)


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads the first ``length`` cached positions of sequences from their blocks.

    block_ids: [B, nb] physical block ids; returns keys and values [B, length, Hkv, D]
    (token-major, as cached).
    """
    batch, nb = block_ids.shape
    ids = block_ids.long().flatten()
    flat = (batch, nb * kv_cache.shape[2], *kv_cache.shape[3:])
    # Float8 blocks are copied as their bytes: not every device's index_select takes float8.
    cache = kv_cache.view(torch.uint8) if is_fp8(kv_cache.dtype) else kv_cache
    # index_select copies whole blocks; advanced indexing is about twice as slow on CPU.
    k = torch.index_select(cache[0], 0, ids).view(kv_cache.dtype).view(flat)[:, :length]
    v = torch.index_select(cache[1], 0, ids).view(kv_cache.dtype).view(flat)[:, :length]
    return k, v


# Decode context lengths are padded up to a multiple of this.
_DECODE_BUCKET = 64


@dataclass
class _DecodeBucket:
    """Decode requests whose context pads to the same length, and what every layer needs of
    them: derived once per forward pass, since all layers share the metadata."""

    # [b] int64: the query rows of the requests.
    token_idx: torch.Tensor
    # [b, num_blocks] int64: their block ids; rows of shorter requests may hold stale or
    # invalid ids past their end (clamped to 0): those positions are masked.
    block_ids: torch.Tensor
    # Padded context length (at most num_blocks * block_size).
    length: int
    # [b, 1, 1, length] bool: positions past each request's context.
    hidden: torch.Tensor


@dataclass
class _Plan:
    """How one forward pass splits into prefills and decode buckets (see forward)."""

    # (request, first query row, query length, context length) of every prefill.
    prefills: list[tuple[int, int, int, int]]
    decodes: list[_DecodeBucket]


def _plan(metadata: AttentionMetadata, block_size: int) -> _Plan:
    """Splits the batch into prefills and decode buckets (once per metadata, see forward)."""
    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    prefills: list[tuple[int, int, int, int]] = []
    buckets: dict[int, list[int]] = {}
    for i in range(metadata.num_reqs):
        query_len = starts[i + 1] - starts[i]
        if query_len == 1:
            # The padded length depends only on a request's own length, so its result is the
            # same in any batch (the reductions' order changes with the padded length).
            buckets.setdefault(-(-seq_lens[i] // _DECODE_BUCKET) * _DECODE_BUCKET, []).append(i)
        elif query_len > 1:
            prefills.append((i, starts[i], query_len, seq_lens[i]))
    device = metadata.block_table.device
    decodes = []
    for longest, reqs in buckets.items():
        num_blocks = min(-(-longest // block_size), metadata.block_table.shape[1])
        length = min(longest, num_blocks * block_size)
        req_idx = torch.tensor(reqs, dtype=torch.long).to(device)
        lens = torch.tensor([seq_lens[i] for i in reqs], dtype=torch.long).to(device)
        visible = torch.arange(length, device=device)[None, :] < lens[:, None]
        decodes.append(
            _DecodeBucket(
                token_idx=torch.tensor([starts[i] for i in reqs], dtype=torch.long).to(device),
                block_ids=metadata.block_table[req_idx, :num_blocks].clamp(min=0).long(),
                length=length,
                hidden=~visible[:, None, None, :],
            )
        )
    return _Plan(prefills, decodes)


class TorchAttentionBackend(AttentionBackend):
    """Paged causal attention with grouped-query support, built on scaled_dot_product_attention.

    Decode requests (one new token) run together in padded, masked batches by context-length
    bucket; other requests run one at a time. A request's result never depends on its batch.
    """

    def cache_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """See AttentionBackend.cache_kv."""
        n = metadata.num_actual_tokens
        write_kv(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n], self.k_scale,
                 self.v_scale)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """See AttentionBackend.attend. Rows past metadata.num_actual_tokens are zeros."""
        out = torch.zeros_like(query)
        # Every layer of the pass sees the same metadata: the first one plans for all.
        plan = metadata.backend_plans.get(TorchAttentionBackend)
        if plan is None:
            plan = metadata.backend_plans[TorchAttentionBackend] = _plan(
                metadata, kv_cache.shape[2]
            )
        for req, start, query_len, seq_len in plan.prefills:
            self._prefill(query, kv_cache, metadata, out, req, start, query_len, seq_len)
        for bucket in plan.decodes:
            self._decode(query, kv_cache, out, bucket)
        return out

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor,
        req: int,
        start: int,
        query_len: int,
        seq_len: int,
    ) -> None:
        block_size = kv_cache.shape[2]
        num_blocks = -(-seq_len // block_size)
        k, v = gather_kv(kv_cache, metadata.block_table[req : req + 1, :num_blocks], seq_len)
        q = query[start : start + query_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        context = seq_len - query_len
        mask = None
        if context > 0:
            # New token j sits at position context + j and sees every position up to it.
            rows = torch.arange(query_len, device=q.device)[:, None] + context
            mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
        k, v = (t.transpose(1, 2).to(q.dtype) for t in (k, v))  # [1, Hkv, seq_len, D]
        score_scale, out_scale = self._read_scales(kv_cache)
        o = self._sdpa(q, k, v, mask, is_causal=mask is None, scale=score_scale)
        if out_scale != 1.0:
            o = o * out_scale
        out[start : start + query_len] = o[0].transpose(0, 1)

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, bucket: _DecodeBucket
    ) -> None:
        k, v = gather_kv(kv_cache, bucket.block_ids, bucket.length)
        batch, group = len(bucket.token_idx), self.num_heads // self.num_kv_heads
        # Plain matmuls rather than SDPA: SDPA's CPU kernel rounds differently with the batch
        # size, these compute every (request, head) on its own. One bmm per KV head reads the
        # gathered keys in place (rows Hkv * D apart); a single matmul over all heads would
        # first copy them into head-major order, which cost more than the products.
        q = query[bucket.token_idx].view(batch, self.num_kv_heads, group, self.head_size)
        k, v = k.to(q.dtype), v.to(q.dtype)
        if batch == 1:
            # torch multiplies a batch of one with its plain matmul kernel, which can round
            # differently from the batched one (seen with 6 heads per KV head): pad to two.
            q, k, v = torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v])
        heads = range(self.num_kv_heads)
        scores = torch.stack([torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)) for h in heads], 1)
        score_scale, out_scale = self._read_scales(kv_cache)
        scores = (scores * score_scale).masked_fill_(bucket.hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.stack([torch.bmm(probs[:, h], v[:, :, h]) for h in heads], 1)[:batch]
        if out_scale != 1.0:
            o = o * out_scale
        out.index_copy_(0, bucket.token_idx, o.reshape(batch, self.num_heads, self.head_size))

    def _read_scales(self, kv_cache: torch.Tensor) -> tuple[float, float]:
        """(score scale, output scale) for reading kv_cache. With an FP8 cache the keys'
        scale folds into the score scale and the values' into the output (attention is
        linear in each), so the gathered blocks need only a dtype conversion."""
        if is_fp8(kv_cache.dtype):
            return self.scale * self.k_scale, self.v_scale
        return self.scale, 1.0

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scale: float,
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
