"""RMS normalization, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers import layer_ops


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, computed in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        # Cast back before scaling so low-precision models round where Hugging Face rounds.
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns norm(x), or, given a residual, (norm(x + residual), x + residual)."""
        # One native call on the CPU in float32 (layer_ops.py); its own summation order.
        native = layer_ops.rms_norm(x, self.weight, self.eps, residual)
        if native is not None:
            return native
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
