"""Exact paged attention in plain torch: the CPU backend and the reference for the others."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm import _custom_ops
from vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata
from vllm.attention.kv_cache_dtype import is_fp8, quantize_fp8
from vllm.model_executor.layers import layer_ops


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
# Bytes of keys (or values, in the compute dtype) one decode tile reads: a tile is gathered,
# multiplied and dropped, so the paged KV is never copied out in full first. Large tiles
# mean few operations per layer, and each one wakes the OpenMP team, which sleeps between
# operations under the engine's PASSIVE wait policy: 16 MiB tiles were 3x faster there than
# 1 MiB ones at batch 64 (docs/architecture.md §6).
_TILE_BYTES = 16 << 20


class _Workspace:
    """Memory that decode chunks are gathered into, reused across layers and steps: a fresh
    tensor per chunk took page faults on first write and unmapping on free."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
             ) -> torch.Tensor:
        """A contiguous uninitialised tensor of `shape`, valid until the next take."""
        numel = torch.Size(shape).numel()
        buf = self._buffer
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffer = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


@dataclass
class _DecodeTile:
    """Up to `rows` decode requests of one bucket, attended together chunk by chunk."""

    # [n] int64: the query rows of the real requests (n <= rows).
    token_idx: torch.Tensor
    # [rows, num_blocks] int64: their block ids. Ids past a request's end may be stale or
    # invalid (clamped to 0): those positions are masked. Padding rows (a tile of one
    # request with a single KV head is padded to two, see _plan) repeat one block, which
    # stays in cache.
    block_ids: torch.Tensor
    # [1, rows, 1, num_blocks * block_size] bool: positions past each request's context,
    # shaped for the head-major scores of _decode_tile.
    hidden: torch.Tensor


@dataclass
class _DecodeBucket:
    """Decode requests whose context pads to the same length, and what every layer needs of
    them: derived once per forward pass, since all layers share the metadata."""

    tiles: list[_DecodeTile]
    # Blocks per chunk: a request's context is read in chunks of this many whole blocks.
    chunk_blocks: int


@dataclass
class _NativeDecodes:
    """Every decode request of a pass, for the native kernel that reads the paged cache in
    place (`_custom_ops.paged_decode_attention`); int64 [n] each."""

    # Query (and output) row of each decode.
    rows: torch.Tensor
    # Its block table row.
    table_rows: torch.Tensor
    # Its context length, the new token included.
    seq_lens: torch.Tensor


@dataclass
class _Plan:
    """How one forward pass splits into prefills and decode buckets (see forward)."""

    # (request, first query row, query length, context length) of every prefill.
    prefills: list[tuple[int, int, int, int]]
    # Decodes for the torch path, empty when `native` holds them.
    decodes: list[_DecodeBucket]
    native: _NativeDecodes | None
    # The planning layer's workspace, which every layer of the pass uses (one per model).
    workspace: _Workspace
    # Query rows the native kernel writes: all of them when the pass is decodes only and
    # unpadded (attend then needs no zeroed output).
    native_rows: int = 0


def _tiling(num_blocks: int, block_size: int, token_bytes: int) -> tuple[int, int]:
    """(blocks per chunk, requests per tile) for decode contexts of num_blocks blocks.

    A chunk depends only on the shapes (never on the batch), so a request's reductions run
    in the same order in any batch. A tile holds at least two requests (see _decode_tile)
    and about _TILE_BYTES of keys (more when one block of two requests is already more)."""
    per_block = block_size * token_bytes
    chunk_blocks = max(1, min(num_blocks, _TILE_BYTES // (2 * per_block)))
    rows = max(2, _TILE_BYTES // (chunk_blocks * per_block))
    return chunk_blocks, rows


def _plan(metadata: AttentionMetadata, block_size: int, token_bytes: int, kv_heads: int,
          workspace: _Workspace, native: bool) -> _Plan:
    """Splits the batch into prefills and decodes, the decodes for the native kernel if
    `native`, else in tiled buckets (once per metadata, see forward). token_bytes: bytes of
    one token's keys in the compute dtype."""
    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    prefills: list[tuple[int, int, int, int]] = []
    buckets: dict[int, list[int]] = {}
    native_reqs: list[int] = []
    for i in range(metadata.num_reqs):
        query_len = starts[i + 1] - starts[i]
        if query_len == 1 and native:
            native_reqs.append(i)
        elif query_len == 1:
            # The padded length depends only on a request's own length, so its result is the
            # same in any batch (the reductions' order changes with the padded length).
            buckets.setdefault(-(-seq_lens[i] // _DECODE_BUCKET) * _DECODE_BUCKET, []).append(i)
        elif query_len > 1:
            prefills.append((i, starts[i], query_len, seq_lens[i]))
    device = metadata.block_table.device
    decodes = []
    for longest, reqs in buckets.items():
        num_blocks = min(-(-longest // block_size), metadata.block_table.shape[1])
        chunk_blocks, rows = _tiling(num_blocks, block_size, token_bytes)
        req_idx = torch.tensor(reqs, dtype=torch.long)
        ids = metadata.block_table[req_idx.to(device), :num_blocks].clamp(min=0).long()
        lens = torch.tensor([seq_lens[i] for i in reqs], dtype=torch.long, device=device)
        token_idx = torch.tensor([starts[i] for i in reqs], dtype=torch.long, device=device)
        positions = torch.arange(num_blocks * block_size, device=device)
        tiles = []
        for first in range(0, len(reqs), rows):
            last = min(first + rows, len(reqs))
            tile_ids, tile_lens = ids[first:last], lens[first:last]
            if last - first == 1 and kv_heads == 1:
                # A padding row over the request's first block: its scores are discarded.
                # (With several KV heads, a tile of one multiplies its heads as one batch.)
                tile_ids = torch.cat([tile_ids, tile_ids[:, :1].expand(1, num_blocks)])
                tile_lens = torch.cat([tile_lens, tile_lens])
            tiles.append(_DecodeTile(
                token_idx=token_idx[first:last],
                block_ids=tile_ids.contiguous(),
                hidden=(positions[None, :] >= tile_lens[:, None])[None, :, None, :],
            ))
        decodes.append(_DecodeBucket(tiles, chunk_blocks))
    natives = None
    if native_reqs:
        natives = _NativeDecodes(
            rows=torch.tensor([starts[i] for i in native_reqs], dtype=torch.long),
            table_rows=torch.tensor(native_reqs, dtype=torch.long),
            seq_lens=torch.tensor([seq_lens[i] for i in native_reqs], dtype=torch.long),
        )
    only_native = natives is not None and not prefills and not decodes
    native_rows = len(native_reqs) if only_native else -1
    return _Plan(prefills, decodes, natives, workspace, native_rows)


def _gather_chunk(
    cache: torch.Tensor, block_ids: torch.Tensor, start: int, end: int, dtype: torch.dtype,
    workspace: _Workspace,
) -> torch.Tensor:
    """Positions start:end (whole blocks) of the keys or values of block_ids [rows, nb],
    from one half of the cache: [rows, end - start, Hkv, D] in dtype, token-major. A cache
    already in dtype is gathered into the workspace (valid until its next take)."""
    block_size, kv_heads, head_size = cache.shape[1:]
    ids = block_ids[:, start // block_size : end // block_size]
    rows, n = ids.shape
    if cache.dtype == dtype:
        out = workspace.take((rows * n, block_size, kv_heads, head_size), dtype, cache.device)
        chunk = torch.index_select(cache, 0, ids.flatten(), out=out)
    else:
        # Float8 blocks are copied as their bytes: not every device's index_select takes
        # float8.
        raw = cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
        chunk = torch.index_select(raw, 0, ids.flatten()).view(cache.dtype).to(dtype)
    return chunk.view(rows, n * block_size, kv_heads, head_size)


class TorchAttentionBackend(AttentionBackend):
    """Paged causal attention with grouped-query support, built on scaled_dot_product_attention.

    Decode requests (one new token) on a float32 CPU cache run in the native kernel, which
    reads the paged cache in place (csrc/cpu/paged_attention.cpp); elsewhere, or without the
    native library, they run together in padded, masked batches by context-length bucket, read
    from the paged cache in tiles (see _decode_tile). Other requests run one at a time. A
    request's result never depends on its batch.
    """

    # Set when this layer first plans a pass (see attend).
    _workspace: _Workspace | None = None

    def cache_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """See AttentionBackend.cache_kv."""
        n = metadata.num_actual_tokens
        key, value, slots = key[:n], value[:n], metadata.slot_mapping[:n]
        # One native copy for a float32 CPU cache (layers/layer_ops.py).
        if not layer_ops.write_kv(key, value, kv_cache, slots):
            write_kv(key, value, kv_cache, slots, self.k_scale, self.v_scale)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """See AttentionBackend.attend. Rows past metadata.num_actual_tokens are zeros."""
        # Every layer of the pass sees the same metadata: the first one plans for all.
        plan = metadata.backend_plans.get(TorchAttentionBackend)
        if plan is None:
            # The first layer plans every pass, so its workspace lasts across steps.
            if self._workspace is None:
                self._workspace = _Workspace()
            plan = metadata.backend_plans[TorchAttentionBackend] = _plan(
                metadata, kv_cache.shape[2], self.num_kv_heads * self.head_size
                * query.element_size(), self.num_kv_heads, self._workspace,
                self._native_decode(query, kv_cache),
            )
        if plan.native_rows == query.shape[0]:
            out = torch.empty_like(query)  # every row is a native decode's: all written
        else:
            out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        for req, start, query_len, seq_len in plan.prefills:
            self._prefill(query, kv_cache, metadata, out, req, start, query_len, seq_len)
        if plan.native is not None:
            _custom_ops.paged_decode_attention(
                query, kv_cache, metadata.block_table, plan.native.rows, plan.native.table_rows,
                plan.native.seq_lens, self.scale, out, torch.get_num_threads(),
            )
        for bucket in plan.decodes:
            self._decode(query, kv_cache, out, bucket, plan.workspace)
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
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, bucket: _DecodeBucket,
        workspace: _Workspace,
    ) -> None:
        score_scale, out_scale = self._read_scales(kv_cache)
        for tile in bucket.tiles:
            o = self._decode_tile(query, kv_cache, tile, bucket.chunk_blocks, score_scale,
                                  workspace)
            if out_scale != 1.0:
                o = o * out_scale
            n = len(tile.token_idx)
            out.index_copy_(0, tile.token_idx, o[:n].reshape(n, self.num_heads, self.head_size))

    def _decode_tile(
        self, query: torch.Tensor, kv_cache: torch.Tensor, tile: _DecodeTile, chunk_blocks: int,
        score_scale: float, workspace: _Workspace,
    ) -> torch.Tensor:
        """Attention of one tile's rows: [rows, num_kv_heads, group, head_size].

        Two passes over the context, a chunk of blocks at a time: the scores of every chunk,
        one exact softmax over each whole row, then the values of every chunk weighted and
        summed. A chunk is gathered and used while it is in cache, token-major as cached:
        each KV head's products read it in place through a strided view. Only the scores
        (heads × context per request, small beside the keys) span the whole context.
        """
        rows, num_blocks = tile.block_ids.shape
        block_size, kv_heads = kv_cache.shape[2], self.num_kv_heads
        group = self.num_heads // kv_heads
        q = query[tile.token_idx].view(-1, kv_heads, group, self.head_size)
        if len(q) < rows:
            q = torch.cat([q, q[:1].expand(rows - len(q), -1, -1, -1)])
        # Head-major: each KV head's products are one batch of `rows` (never a batch of one,
        # a tile has two rows at least: torch multiplies a batch of one with its plain matmul
        # kernel, which can round differently; seen with 6 heads per KV head).
        q = q.transpose(0, 1).contiguous()  # [kv_heads, rows, group, D]
        scores = torch.empty(kv_heads, rows, group, num_blocks * block_size, dtype=q.dtype,
                             device=q.device)
        spans = [(first * block_size, min(num_blocks, first + chunk_blocks) * block_size)
                 for first in range(0, num_blocks, chunk_blocks)]
        # Each product is one matrix of a KV head and a request, laid out the same in any
        # tile: a tile of several requests batches them per KV head, a tile of one (only
        # with several KV heads, see _plan) batches its KV heads.
        if rows == 1:
            parts = [(slice(None), 0, lambda c: c[0].transpose(0, 1))]
        else:
            parts = [(h, slice(None), lambda c, h=h: c[:, :, h]) for h in range(kv_heads)]
        for start, end in spans:
            k = _gather_chunk(kv_cache[0], tile.block_ids, start, end, q.dtype, workspace)
            for h, r, view in parts:
                torch.bmm(q[h, r], view(k).transpose(1, 2), out=scores[h, r, :, start:end])
        scores.mul_(score_scale).masked_fill_(tile.hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.empty(kv_heads, rows, group, self.head_size, dtype=q.dtype, device=q.device)
        for i, (start, end) in enumerate(spans):
            v = _gather_chunk(kv_cache[1], tile.block_ids, start, end, q.dtype, workspace)
            for h, r, view in parts:
                part = probs[h, r, :, start:end]
                if i == 0:
                    torch.bmm(part, view(v), out=o[h, r])
                else:
                    o[h, r].add_(torch.bmm(part, view(v)))
        return o.transpose(0, 1)

    def _native_decode(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether this pass's decodes run in the native kernel: float32 on the CPU, with the
        native library loaded."""
        return (query.device.type == "cpu" and query.dtype == torch.float32
                and kv_cache.dtype == torch.float32 and _custom_ops.HAS_NATIVE)

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
