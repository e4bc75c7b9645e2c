"""The attention interface every backend implements.

The KV cache of one layer is a tensor of shape
``[2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 holds keys, 1 values).
A batch is flat and variable-length: request i owns query tokens
``query_start_loc[i]:query_start_loc[i+1]`` and, after this step, ``seq_lens[i]`` tokens
of context in the cache (the new tokens are the last ones of that context).

The cache holds the model's dtype, or float8_e4m3fn under `--kv-cache-dtype fp8`: then a
backend writes key / k_scale and value / v_scale saturated to the e4m3 range, and reads
dequantize (vllm/attention/kv_cache_dtype.py). A backend tells the two apart by the dtype
of the cache tensor it is given, so models need not know which cache they run on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vllm.attention.kv_cache_dtype import check_kv_scale


@dataclass
class AttentionMetadata:
    """Flat varlen description of one forward pass, shared by all layers."""

    # Real tokens in the input; inputs may be padded past this (e.g. for CUDA graphs).
    num_actual_tokens: int
    # Number of requests in the batch.
    num_reqs: int
    # Longest query (new tokens) of any request in the batch.
    max_query_len: int
    # Longest context (cached + new tokens) of any request in the batch.
    max_seq_len: int
    # [num_reqs + 1] int32 on the device: prefix sums of new tokens per request.
    query_start_loc: torch.Tensor
    # [num_reqs] int32 on the device: context length per request including new tokens.
    seq_lens: torch.Tensor
    # [num_reqs, max_blocks_per_req] int32 on the device: physical block ids per request.
    block_table: torch.Tensor
    # [num_tokens] int64 on the device: cache slot (block * block_size + offset) per token,
    # -1 for padding tokens whose K/V must not be written.
    slot_mapping: torch.Tensor
    # CPU copies of query_start_loc and seq_lens, so backends can loop without a device sync.
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    # Per backend class: what it derived from the fields above, built by the first layer of
    # the forward pass and reused by the others (the metadata is made anew every step).
    backend_plans: dict[type, Any] = field(default_factory=dict)


class AttentionBackend(ABC):
    """One attention implementation; a model holds one instance per attention layer."""

    # Whether forward reads `query_start_loc_cpu`/`seq_lens_cpu`: a runner that corrects the
    # device lengths after staging (docs/architecture.md §11) must then copy them back.
    reads_host_lengths: ClassVar[bool] = True
    # Whether a forward can be captured in a CUDA graph and replayed: it must make no host
    # sync and read only device tensors whose addresses stay fixed between steps.
    supports_cuda_graphs: ClassVar[bool] = False
    # The CUDA compute capability an FP8 cache needs with this backend (None: any device).
    fp8_min_capability: ClassVar[tuple[int, int] | None] = None

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> None:
        """Raises ValueError on non-positive sizes or when num_kv_heads does not divide
        num_heads (grouped-query attention shares each KV head among a whole group)."""
        if num_heads <= 0 or num_kv_heads <= 0 or head_size <= 0:
            raise ValueError(
                f"num_heads/num_kv_heads/head_size: must be positive, got {num_heads}/"
                f"{num_kv_heads}/{head_size}"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads: {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # Per-tensor FP8 scales of this layer's keys and values (used only with an FP8
        # cache); the loader sets them from the checkpoint through set_kv_scales.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def set_kv_scales(self, k_scale: float | None = None, v_scale: float | None = None) -> None:
        """Sets the FP8 cache scale of keys and/or values (None keeps the current one).

        Raises ValueError for a scale that is not finite and positive."""
        if k_scale is not None:
            self.k_scale = check_kv_scale(k_scale, "k_scale")
        if v_scale is not None:
            self.v_scale = check_kv_scale(v_scale, "v_scale")

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Writes the new key/value into kv_cache at metadata.slot_mapping, then returns causal
        attention output for every query token.

        query: [num_tokens, num_heads, head_size]; key, value: [num_tokens, num_kv_heads,
        head_size]; returns [num_tokens, num_heads, head_size]. Rows past
        metadata.num_actual_tokens are padding: their K/V are never written and their output
        is unspecified. Side effect: kv_cache is modified in place. Raises ValueError on
        shape mismatches (before writing anything).
        """
        self._check_shapes(query, key, value, metadata)
        self.cache_kv(key, value, kv_cache, metadata)
        return self.attend(query, kv_cache, metadata)

    def _check_shapes(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
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

    @abstractmethod
    def cache_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """Writes the key/value of the first metadata.num_actual_tokens tokens into kv_cache
        at their metadata.slot_mapping slots (slot -1: not written)."""

    @abstractmethod
    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Causal attention of every query token over its request's context in kv_cache
        (this step's key/value already written); [num_tokens, num_heads, head_size]."""
