"""AWQ 4-bit checkpoints (``quant_method: awq``, AutoAWQ's GEMM packing).

Per linear layer: ``qweight`` [in, out / 8] int32 and ``qzeros`` [groups, out / 8] int32,
8 output columns per word in AWQ's interleaved order (word slot i holds column
AWQ_ORDER[i] of its 8), and ``scales`` [groups, out]; groups are contiguous runs of
``group_size`` input rows. The weight is ``(q - zero) * scale``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig
from vllm.model_executor.layers.quantization.gptq import (
    SCALE_DTYPE,
    int4_group_size,
    packed_layer_method,
)
from vllm.model_executor.layers.quantization.int4 import PACKED, PackedInt4Method, ParamSpec
from vllm.model_executor.layers.quantization.packing import INT4_PER_INT32, Axis

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Column j of a word's 8 sits in slot _SLOT_OF[j].
_SLOT_OF = tuple(AWQ_ORDER.index(j) for j in range(INT4_PER_INT32))


def unpack_awq(packed: torch.Tensor, shifts: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, cols / 8] AWQ words -> [rows, cols] values 0..15 in column order.

    ``shifts`` (int32 [8], bit offset of each column's slot: ``awq_shifts``) may be given
    on the words' device, so that no tensor is created from host data in a forward pass
    (which CUDA graph capture forbids)."""
    if shifts is None:
        shifts = awq_shifts(packed.device)
    values = (packed.unsqueeze(-1) >> shifts).bitwise_and_(0xF)
    return values.flatten(-2)


def awq_shifts(device: torch.device) -> torch.Tensor:
    """The bit offset of each of a word's 8 columns, in column order."""
    return torch.tensor([4 * slot for slot in _SLOT_OF], dtype=torch.int32, device=device)


class AwqLinearMethod(PackedInt4Method):
    """Dequantizes AWQ's packed tensors (see the module docstring)."""

    def specs(self, in_full: int) -> dict[str, ParamSpec]:
        """See PackedInt4Method.specs."""
        groups = self.group_axis(in_full)
        hint = f"{groups.what} from quantization_config"
        packed_out = Axis("out", INT4_PER_INT32, PACKED)
        return {
            "qweight": ((Axis("in"), packed_out), torch.int32,
                        "4-bit values packed 8 per int32 along the output"),
            "qzeros": ((groups, packed_out), torch.int32, hint),
            "scales": ((groups, Axis("out")), SCALE_DTYPE, hint),
        }

    def create(self, layer: nn.Module, out_size: int, in_size: int, in_full: int) -> None:
        """See PackedInt4Method.create; also keeps the unpacking shifts on the device."""
        super().create(layer, out_size, in_size, in_full)
        layer.register_buffer("awq_shifts", awq_shifts(layer.qweight.device), persistent=False)

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """See PackedInt4Method.dequantize."""
        groups = self.group_of_columns(layer)
        q = unpack_awq(layer.qweight, layer.awq_shifts)  # [in, out]
        zeros = unpack_awq(layer.qzeros, layer.awq_shifts)[groups]
        w = (q - zeros).to(dtype) * layer.scales.to(dtype)[groups]
        return w.t()


class AwqConfig(QuantizationConfig):
    """An AWQ ``quantization_config``: bits 4, group_size, zero_point, version gemm.
    Layers whose ``qweight`` the checkpoint holds are quantized, except those named in
    ``modules_to_not_convert``."""

    name = "awq"

    def __init__(self, config: dict[str, Any]) -> None:
        group_size = int4_group_size(config, "awq")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version: {version!r} is not supported "
                             "(only gemm packing)")
        if not config.get("zero_point", True):
            raise ValueError("quantization_config.zero_point: false is not supported (AWQ "
                             "checkpoints with zero points only)")
        self.skip = [str(m) for m in config.get("modules_to_not_convert") or []]
        self.method = AwqLinearMethod(group_size)

    def linear_method(self, names: list[str], keys: frozenset[str]) -> LinearMethod | None:
        """See QuantizationConfig.linear_method."""
        if any(skip in name for name in names for skip in self.skip):
            return None
        return packed_layer_method(self.method, names, keys, "qweight")
