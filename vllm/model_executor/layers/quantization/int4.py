"""Shared machinery of the 4-bit weight-only formats (compressed-tensors W4A16, GPTQ,
AWQ): int32 words of eight 4-bit values plus a scale (and zero point) per group of input
columns, kept packed and dequantized to the activation dtype in every forward."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.quantization.base import LinearMethod, Shard
from vllm.model_executor.layers.quantization.packing import (
    INT4_PER_INT32,
    Axis,
    local_shape,
    read_shard,
)
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor

# A layout, the dtype of its parameter (None: the model's dtype) and what sets its shape.
ParamSpec = tuple[tuple[Axis, ...], torch.dtype | None, str]

PACKED = "8 int4 values per int32"


class PackedInt4Method(LinearMethod):
    """A 4-bit method whose parameters follow ``specs``; subclasses dequantize.

    ``group_size`` input columns share a scale; None means one group per row (channel).
    ``act_order`` (GPTQ desc_act) means the groups are not contiguous, so a row-parallel
    rank keeps every group's scales.
    """

    def __init__(self, group_size: int | None, act_order: bool = False) -> None:
        self.group_size = group_size
        self.act_order = act_order

    def group_axis(self, in_full: int) -> Axis:
        """The layout of a per-group dimension for a weight of ``in_full`` columns."""
        if self.group_size is None:
            return Axis("all_in", in_full, "one group per row")
        kind = "all_in" if self.act_order else "in"
        return Axis(kind, self.group_size, f"group_size {self.group_size}")

    @abstractmethod
    def specs(self, in_full: int) -> dict[str, ParamSpec]:
        """Checkpoint name -> ParamSpec of every parameter of the layer."""

    @abstractmethod
    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's local weight [out, in] in ``dtype``."""

    def create(self, layer: nn.Module, out_size: int, in_size: int, in_full: int) -> None:
        """See LinearMethod.create. Also records the group count and the column size."""
        if in_size % INT4_PER_INT32 or (self.group_size and in_size % self.group_size):
            raise ValueError(
                f"input size {in_size} is not a multiple of the packing (8) and the group "
                f"size ({self.group_size}); use a tensor-parallel size that splits it evenly"
            )
        for name, (layout, dtype, _) in self.specs(in_full).items():
            shape = local_shape(layout, out_size, in_size, in_full, name)
            param = torch.empty(shape, dtype=dtype or torch.get_default_dtype())
            layer.register_parameter(name, nn.Parameter(param, requires_grad=False))
        kept = in_full if self.act_order else in_size
        layer.num_groups = 1 if self.group_size is None else kept // self.group_size
        layer.packed_sizes = (out_size, in_size)

    def load(self, layer: nn.Module, name: str, tensor: CheckpointTensor, shard: Shard) -> None:
        """See LinearMethod.load."""
        spec = self.specs(shard.in_full).get(name)
        if spec is None:
            raise ValueError(f"this layer has no {name!r} parameter")
        layout, _, hint = spec
        read_shard(getattr(layer, name), tensor, layout, shard, name, hint)
        self.after_load(layer, name, shard)

    def after_load(self, layer: nn.Module, name: str, shard: Shard) -> None:
        """Checks or adjusts a parameter just loaded (default: nothing)."""

    def group_of_columns(self, layer: nn.Module) -> torch.Tensor:
        """The scale group of each local input column (contiguous groups)."""
        _, in_size = layer.packed_sizes
        size = self.group_size or in_size
        device = next(iter(layer.parameters())).device
        return torch.arange(in_size, device=device) // size

    def kernel_args(self, layer: nn.Module) -> dict[str, Any] | None:
        """Arguments of int4_triton.int4_matmul (after x) for this layer; None when the
        format's packing has no Triton kernel (the default)."""
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """See LinearMethod.apply: the Triton kernel on CUDA where the format has one,
        else the weight dequantized in torch."""
        if x.device.type == "cuda":
            args = self.kernel_args(layer)
            if args is not None:
                from vllm.model_executor.layers.quantization.int4_triton import int4_matmul

                return int4_matmul(x, **args)
        return F.linear(x, self.dequantize(layer, x.dtype))
