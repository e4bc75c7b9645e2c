"""GPTQ 4-bit checkpoints (``quant_method: gptq``, as AutoGPTQ / GPTQModel write them).

Per linear layer: ``qweight`` [in / 8, out] int32 (8 input rows per word, the first in
the lowest bits), ``qzeros`` [groups, out / 8] int32 (8 output columns per word),
``scales`` [groups, out] and ``g_idx`` [in], each input row's group. The weight is
``(q - zero) * scale`` of its group; the ``gptq`` checkpoint format stores zero - 1
(``gptq_v2`` stores the zero itself). With ``desc_act`` the rows were quantized in
activation order, so g_idx is a permutation of the groups and a row-parallel rank keeps
every group's scales.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig, Shard
from vllm.model_executor.layers.quantization.int4 import PACKED, PackedInt4Method, ParamSpec
from vllm.model_executor.layers.quantization.packing import INT4_PER_INT32, Axis, unpack_int4
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor

# GPTQ and AWQ store float16 scales; a bfloat16 model keeps them as they are rather than
# dropping three of their mantissa bits.
SCALE_DTYPE = torch.float16


def int4_group_size(config: dict[str, Any], method: str) -> int | None:
    """Checks ``bits`` and returns the group size (None: one group per row)."""
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.bits: {bits!r} is not supported for {method} "
                         "(only 4)")
    group_size = config.get("group_size", config.get("q_group_size", 128))
    if not isinstance(group_size, int) or group_size == 0 or group_size < -1:
        raise ValueError(f"quantization_config.group_size: {group_size!r} must be a positive "
                         "integer or -1 (one group per row)")
    return None if group_size == -1 else group_size


class GptqLinearMethod(PackedInt4Method):
    """Dequantizes GPTQ's packed tensors (see the module docstring)."""

    def __init__(self, group_size: int | None, act_order: bool, zero_offset: int) -> None:
        super().__init__(group_size, act_order)
        self.zero_offset = zero_offset

    def specs(self, in_full: int) -> dict[str, ParamSpec]:
        """See PackedInt4Method.specs."""
        groups = self.group_axis(in_full)
        hint = f"{groups.what} from quantization_config"
        return {
            "qweight": ((Axis("in", INT4_PER_INT32, PACKED), Axis("out")), torch.int32,
                        "4-bit values packed 8 per int32 along the input"),
            "qzeros": ((groups, Axis("out", INT4_PER_INT32, PACKED)), torch.int32, hint),
            "scales": ((groups, Axis("out")), SCALE_DTYPE, hint),
            "g_idx": ((Axis("in"),), torch.int32, "one group index per input row"),
        }

    def load(self, layer: nn.Module, name: str, tensor: CheckpointTensor,
             shard: Shard) -> None:
        """See LinearMethod.load. The parts of a fused layer (q/k/v, gate/up) share one
        g_idx: they see the same input, so GPTQ orders their rows alike; a part whose
        g_idx differs is refused."""
        previous = None
        if name == "g_idx" and getattr(layer, "g_idx_loaded", False):
            previous = layer.g_idx.data.clone()
        super().load(layer, name, tensor, shard)
        if name == "g_idx":
            layer.g_idx_loaded = True
            if previous is not None and not torch.equal(previous, layer.g_idx.data):
                raise ValueError("g_idx differs from the other parts of this fused layer; "
                                 "they share one input, so one activation order is required")

    def after_load(self, layer: nn.Module, name: str, shard: Shard) -> None:
        """Makes g_idx index this rank's groups and checks every index is one of them."""
        if name != "g_idx":
            return
        g_idx = layer.g_idx.data
        if self.group_size is None:
            g_idx.zero_()  # one group per row, whatever the checkpoint wrote
        elif not self.act_order:
            g_idx.sub_(shard.in_start // self.group_size)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= layer.num_groups):
            raise ValueError(
                f"g_idx has group indices outside 0..{layer.num_groups - 1} for this layer's "
                f"rows (group_size {self.group_size} from quantization_config)"
            )

    def kernel_args(self, layer: nn.Module) -> dict[str, Any] | None:
        """See PackedInt4Method.kernel_args: words [in / 8, out], scales [groups, out],
        zeros [groups, out / 8], each input row's group from g_idx."""
        w, s, z = layer.qweight, layer.scales, layer.qzeros
        return {
            "words": w, "word_strides": (w.stride(1), w.stride(0)),
            "scales": s, "scale_strides": (s.stride(1), s.stride(0)),
            "zeros": z, "zero_strides": (z.stride(1), z.stride(0)),
            "out_size": layer.packed_sizes[0], "zero_bias": self.zero_offset,
            "g_idx": layer.g_idx,
        }

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """See PackedInt4Method.dequantize."""
        q = unpack_int4(layer.qweight, 0)  # [in, out]
        zeros = unpack_int4(layer.qzeros, 1) + self.zero_offset  # [groups, out]
        g_idx = layer.g_idx.long()
        w = (q - zeros[g_idx]).to(dtype) * layer.scales.to(dtype)[g_idx]
        return w.t()


class GptqConfig(QuantizationConfig):
    """A GPTQ ``quantization_config``: bits 4, group_size, desc_act, checkpoint_format.
    Layers whose ``qweight`` the checkpoint holds are quantized; the rest are not."""

    name = "gptq"

    def __init__(self, config: dict[str, Any]) -> None:
        group_size = int4_group_size(config, "gptq")
        fmt = config.get("checkpoint_format", "gptq") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format: {fmt!r} is not supported "
                             "(gptq or gptq_v2)")
        act_order = bool(config.get("desc_act", False))
        self.method = GptqLinearMethod(group_size, act_order, 1 if fmt == "gptq" else 0)

    def linear_method(self, names: list[str], keys: frozenset[str]) -> LinearMethod | None:
        """See QuantizationConfig.linear_method."""
        return packed_layer_method(self.method, names, keys, "qweight")


def packed_layer_method(method: LinearMethod, names: list[str], keys: frozenset[str],
                        marker: str) -> LinearMethod | None:
    """``method`` when the checkpoint holds ``{name}.{marker}`` for every part, None when
    for none. Raises ValueError naming the parts when only some are quantized."""
    present = [f"{n}.{marker}" in keys for n in names]
    if all(present):
        return method
    if not any(present):
        return None
    raise ValueError(
        f"checkpoint: {', '.join(names)} are fused into one layer here but only some of them "
        f"have a {marker!r} tensor"
    )
