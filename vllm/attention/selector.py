"""Picks the attention backend class for a name and a device."""

from __future__ import annotations

import torch

from vllm.attention.backends.abstract import AttentionBackend


def get_attn_backend_cls(name: str, device: torch.device) -> type[AttentionBackend]:
    """Returns the backend class for "torch", "triton" or "auto" (torch on CPU, triton on CUDA).

    Raises ValueError for any other name.
    """
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        from vllm.attention.backends.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "triton":
        # Imported lazily: triton is heavy and only needed when selected.
        from vllm.attention.backends.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    raise ValueError(f"attention_backend: {name!r} is not one of auto, torch, triton")
