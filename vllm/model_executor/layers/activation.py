"""Activation functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers import layer_ops


class SiluAndMul(nn.Module):
    """Gated SiLU: splits the last dimension into halves [gate, up] and returns silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [..., 2 * d] to [..., d]."""
        # One native call on the CPU in float32 (layer_ops.py); its own exponential.
        native = layer_ops.silu_and_mul(x)
        if native is not None:
            return native
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
