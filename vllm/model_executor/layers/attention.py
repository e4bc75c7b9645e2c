"""The attention layer: hands projected q/k/v to an attention backend."""

from __future__ import annotations

import torch
from torch import nn

from vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged causal attention over flat [T, heads * head_size] inputs; projects nothing."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        backend_cls: type[AttentionBackend],
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.backend = backend_cls(num_heads, head_size, num_kv_heads, scale)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns [T, num_heads * head_size] attention output.

        Side effect: writes this step's key/value into kv_cache (see AttentionBackend.forward).
        """
        t = query.shape[0]
        out = self.backend.forward(
            query.view(t, self.num_heads, self.head_size),
            key.view(t, self.num_kv_heads, self.head_size),
            value.view(t, self.num_kv_heads, self.head_size),
            kv_cache,
            metadata,
        )
        return out.reshape(t, self.num_heads * self.head_size)
