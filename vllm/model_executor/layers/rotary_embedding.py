"""Rotary position embedding (neox style: rotate the two halves of each head)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers import layer_ops


def rope_parameters(config: Any) -> dict[str, Any]:
    """Reads RoPE settings from a Hugging Face config, old or new layout.

    Returns a dict with at least ``rope_theta`` and ``rope_type``. Newer transformers keep them
    in ``config.rope_parameters``; older ones in ``config.rope_theta`` and ``config.rope_scaling``
    (whose type key may be ``type`` instead of ``rope_type``).
    """
    params: dict[str, Any] = {}
    for source in (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None)):
        if isinstance(source, dict):
            params.update(source)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow the low frequencies, keep the high ones, blend between."""
    try:
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"rope_scaling: llama3 needs {e.args[0]!r}") from e
    if high <= low:
        raise ValueError(
            f"rope_scaling: high_freq_factor ({high}) must exceed low_freq_factor ({low})"
        )
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flat query/key tensors given an explicit position per token.

    Supports rope_type "default", "linear" and "llama3"; others raise ValueError at construction.
    cos/sin tables are precomputed in float32 for every position below max_position.
    """

    def __init__(self, head_size: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        if head_size % 2 != 0:
            raise ValueError(f"head_dim: RoPE needs an even head size, got {head_size}")
        self.head_size = head_size
        base = float(params.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", "default")
        exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
        inv_freq = 1.0 / (base**exponents)
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type != "default":
            raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported")
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, self.head_size)
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.view(t, -1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query [T, H * D] and key [T, Hkv * D] by positions [T]; returns new tensors."""
        # One native call on the CPU in float32 (layer_ops.py), the same numbers.
        native = layer_ops.rotary_neox(positions, query, key, self.cos_cache, self.sin_cache,
                                       self.head_size)
        if native is not None:
            return native
        cos = self.cos_cache[positions].to(query.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(query.dtype).unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)
