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
    triton was first imported in the process. num_splits: None lets a heuristic pick split-KV for long decode-only batches,
    1 never splits, a power of two > 1 always splits each context into that many segments.
    Raises ValueError on inconsistent head counts or a bad num_splits.
    """

    reads_host_lengths = False
    supports_cuda_graphs = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        num_splits: int | None = None,
    ) -> None:
        if num_heads <= 0 or num_kv_heads <= 0 or head_size <= 0:
            raise ValueError(
                f"num_heads/num_kv_heads/head_size: must be positive, got {num_heads}/"
                f"{num_kv_heads}/{head_size}"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads: {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
            raise ValueError(f"num_splits: must be a power of two >= 1, got {num_splits}")
        super().__init__(num_heads, head_size, num_kv_heads, scale)
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

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Writes key/value into kv_cache at metadata.slot_mapping and returns causal attention.

        Shapes as in AttentionBackend.forward. Rows past metadata.num_actual_tokens are
        zeros in the result and their K/V are never written. Makes no host-device sync.
        Side effect: kv_cache is modified in place. Raises ValueError on shape mismatches.
        """
        expected_q = (self.num_heads, self.head_size)
        expected_kv = (self.num_kv_heads, self.head_size)
        if query.dim() != 3 or tuple(query.shape[1:]) != expected_q:
            raise ValueError(f"query: expected [T, {expected_q[0]}, {expected_q[1]}], got "
                             f"{tuple(query.shape)}")
        if key.shape != (query.shape[0], *expected_kv) or value.shape != key.shape:
            raise ValueError(
                f"key/value: expected [{query.shape[0]}, {expected_kv[0]}, {expected_kv[1]}], "
                f"got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        n = metadata.num_actual_tokens
        if n > query.shape[0]:
            raise ValueError(
                f"metadata.num_actual_tokens: {n} exceeds the {query.shape[0]} input tokens"
            )
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping, num_tokens=n)
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
        )
        # Padding rows would otherwise hold uninitialised memory (possibly inf/nan) that
        # later layers would carry along.
        if n < out.shape[0]:
            out[n:].zero_()
        return out
