"""Dense linear layers, including fused projections that load from several checkpoint tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """A dense ``y = x W^T + b`` layer whose weights are filled by the model loader."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # Uninitialized on purpose: the loader overwrites every parameter, and initializing
        # billions of weights only to discard them would slow startup.
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the layer to the last dimension of x."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several linear layers over the same input, stored as one matrix (e.g. q/k/v or gate/up).

    Output ``i`` occupies rows ``offsets[i]:offsets[i] + output_sizes[i]`` of the fused weight.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, param_name: str, index: int, tensor: torch.Tensor) -> None:
        """Copies one checkpoint tensor into part ``index`` of ``weight`` or ``bias``.

        Raises ValueError if the part does not exist or the tensor has the wrong shape.
        """
        if not 0 <= index < len(self.output_sizes):
            raise ValueError(f"shard index {index} out of range for {len(self.output_sizes)} parts")
        param = getattr(self, param_name, None)
        if param is None:
            raise ValueError(f"this layer has no {param_name!r} parameter")
        start, size = self.offsets[index], self.output_sizes[index]
        target = param.data.narrow(0, start, size)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"shape {tuple(tensor.shape)} does not match expected {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Splits a fused output into the outputs of the individual layers."""
        return tuple(y.split(self.output_sizes, dim=-1))
