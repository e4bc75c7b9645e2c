"""Activation functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """Gated SiLU: splits the last dimension into halves [gate, up] and returns silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [..., 2 * d] to [..., d]."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
