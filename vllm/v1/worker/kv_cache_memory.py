"""The paged KV cache's memory: the bytes of a block, and zeroed allocation."""

from __future__ import annotations

import math

import numpy as np
import torch


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one KV block (keys and values of block_size tokens) across num_layers
    layers when the cache stores `dtype`."""
    return num_layers * block_size * 2 * num_kv_heads * head_dim * dtype.itemsize


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its memory comes from calloc (numpy's zeros), whose pages
    the kernel zeroes on first touch: writing 2 GiB of zeros up front took 3.9 s at
    startup, and a cache is rarely filled whole."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
