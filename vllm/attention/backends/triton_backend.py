"""Attention backend built on the Triton paged-cache write and unified attention kernels."""

from __future__ import annotations

import torch

from vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata
from vllm.attention.ops.triton_reshape_and_cache import reshape_and_cache
from vllm.attention.ops.triton_unified_attention import unified_attention

# Used for the split-KV heuristic when the device cannot be asked (CPU interpreter).
_DEFAULT_NUM_SMS = 132


class TritonAttentionBackend(AttentionBackend):
    """Paged varlen attention (prefill chunks and decodes in one kernel launch) in Triton.

    Runs on CUDA, or on the CPU (slowly; for tests) when TRITON_INTERPRET=1 was set before
    triton was first imported in the process. num_splits: None lets a heuristic pick split-KV
    for long decode-only batches, 1 never splits, a power of two > 1 always splits each
    context into that many segments. Raises ValueError on inconsistent head counts or a bad
    num_splits.
    """

    reads_host_lengths = False
    supports_cuda_graphs = True
    # Triton's float8 e4m3 type exists from Ada / Hopper on.
    fp8_min_capability = (8, 9)

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        num_splits: int | None = None,
    ) -> None:
        super().__init__(num_heads, head_size, num_kv_heads, scale)
        if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
            raise ValueError(f"num_splits: must be a power of two >= 1, got {num_splits}")
        self.num_splits = num_splits
        self._num_sms: int | None = None

    def _sm_count(self, device: torch.device) -> int:
        """Streaming multiprocessors of device (a default off CUDA); cached per instance."""
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = _DEFAULT_NUM_SMS
        return self._num_sms

    def cache_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """See AttentionBackend.cache_kv. Makes no host-device sync."""
        reshape_and_cache(
            key, value, kv_cache, metadata.slot_mapping, num_tokens=metadata.num_actual_tokens,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """See AttentionBackend.attend. Rows past metadata.num_actual_tokens are zeros. Makes
        no host-device sync."""
        n = metadata.num_actual_tokens
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        unified_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            out,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            num_tokens=n,
            num_reqs=metadata.num_reqs,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            scale=self.scale,
            num_splits=self.num_splits,
            num_sms=self._sm_count(query.device),
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        # Padding rows would otherwise hold uninitialised memory (possibly inf/nan) that
        # later layers would carry along.
        if n < out.shape[0]:
            out[n:].zero_()
        return out
