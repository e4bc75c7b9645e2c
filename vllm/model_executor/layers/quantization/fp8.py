"""FP8 (e4m3) weights with one float32 scale per output channel.

Two sources fill them: a compressed-tensors FP8 checkpoint (per-channel or per-tensor
scales; a per-tensor scale is repeated over its rows, which also lets the q/k/v parts of
a fused layer keep their own scales) and ``--quantization fp8`` on a full-precision
checkpoint, which quantizes each row at load. The matmul runs torch._scaled_mm with a
dynamic activation scale where the GPU has FP8 tensor cores (compute capability 8.9+);
elsewhere it dequantizes the weight and multiplies in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig, Shard
from vllm.model_executor.layers.quantization.packing import Axis, read_shard
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# Scales never reach zero, so an all-zero row or activation divides safely.
_MIN_SCALE = 1e-12
_ROWS = (Axis("out"), Axis("in"))


def _scaled_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Row-wise scaled FP8 GEMMs need FP8 tensor cores, bf16 output and 16-aligned sizes.
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               per_token: bool = True) -> torch.Tensor:
    """``x (weight * scale[:, None])^T`` for an FP8 weight [out, in] and float32 row
    scales [out]; on FP8-capable GPUs x is quantized on the fly (per token, or one scale
    for the whole batch) and multiplied by torch._scaled_mm."""
    if not _scaled_mm_ok(x, weight):
        return F.linear(x, weight.to(x.dtype) * scale.to(x.dtype).unsqueeze(1))
    rows = x.reshape(-1, x.shape[-1])
    if per_token:
        x_scale = rows.abs().amax(dim=-1, keepdim=True).float()
    else:
        x_scale = rows.abs().amax().float().expand(rows.shape[0], 1)
    x_scale = x_scale.clamp(min=_MIN_SCALE) / FP8_MAX
    xq = (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.contiguous(),
                         scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale per row) with each row's largest magnitude at FP8_MAX."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=_MIN_SCALE) / FP8_MAX
    q = (w / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class Fp8LinearMethod(LinearMethod):
    """FP8 weight ``weight`` [out, in] and float32 ``weight_scale`` [out].

    ``serialized``: the checkpoint holds both (compressed-tensors); ``per_tensor`` then
    says its scale is one value per checkpoint tensor. Otherwise the checkpoint holds a
    full-precision ``weight`` and the scale is computed at load (a buffer, not a
    checkpoint tensor).
    """

    def __init__(self, serialized: bool, per_tensor: bool = False,
                 per_token: bool = True) -> None:
        self.serialized = serialized
        self.per_tensor = per_tensor
        self.per_token = per_token

    def create(self, layer: nn.Module, out_size: int, in_size: int, in_full: int) -> None:
        """See LinearMethod.create."""
        layer.weight = nn.Parameter(torch.empty(out_size, in_size, dtype=FP8_DTYPE),
                                    requires_grad=False)
        scale = torch.empty(out_size, dtype=torch.float32)
        if self.serialized:
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        else:
            layer.register_buffer("weight_scale", scale)

    def load(self, layer: nn.Module, name: str, tensor: CheckpointTensor, shard: Shard) -> None:
        """See LinearMethod.load. Raises ValueError for a weight that is not FP8 in a
        serialized checkpoint (see read_shard), or a scale of the wrong shape."""
        if name == "weight":
            if not self.serialized:
                self._quantize(layer, tensor, shard)
                return
            read_shard(layer.weight, tensor, _ROWS, shard, name)
        elif name == "weight_scale" and self.serialized:
            self._load_scale(layer, tensor, shard)
        else:
            raise ValueError(f"this layer has no {name!r} parameter")

    def _quantize(self, layer: nn.Module, tensor: CheckpointTensor, shard: Shard) -> None:
        staged = torch.empty(shard.out_len, shard.in_len, dtype=torch.float32,
                             device=layer.weight.device)
        read_shard(staged, tensor, _ROWS, _local(shard), "weight")
        q, scale = quantize_rows(staged)
        with torch.no_grad():
            layer.weight.data.narrow(0, shard.out_offset, shard.out_len).copy_(q)
            layer.weight_scale.narrow(0, shard.out_offset, shard.out_len).copy_(scale)

    def _load_scale(self, layer: nn.Module, tensor: CheckpointTensor, shard: Shard) -> None:
        target = layer.weight_scale.data.narrow(0, shard.out_offset, shard.out_len)
        if self.per_tensor:
            if tensor.shape not in ((), (1,)):
                raise ValueError(
                    f"shape {tuple(tensor.shape)} does not match expected (1,) (a per-tensor "
                    "weight scale, strategy 'tensor' in quantization_config)"
                )
            with torch.no_grad():
                target.fill_(float(tensor.read().reshape(-1)[0]))
            return
        read_shard(target.view(-1, 1), tensor, (Axis("out"), Axis("fixed", 1)),
                   _rows_only(shard), "weight_scale",
                   "one scale per output channel, strategy 'channel' in quantization_config")

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """See LinearMethod.apply."""
        return fp8_matmul(x, layer.weight, layer.weight_scale, self.per_token)


def _local(shard: Shard) -> Shard:
    # The rows a rank keeps, read into a staging tensor of exactly that size.
    return Shard(shard.out_full, shard.out_start, shard.out_len, 0,
                 shard.in_full, shard.in_start, shard.in_len)


def _rows_only(shard: Shard) -> Shard:
    # A scale column vector: the shard's rows, already placed by the caller.
    return Shard(shard.out_full, shard.out_start, shard.out_len, 0, 1, 0, 1)


class Fp8Config(QuantizationConfig):
    """``--quantization fp8`` on a full-precision checkpoint: every attention and dense
    MLP projection is quantized at load to FP8 with per-channel scales."""

    name = "fp8"

    def __init__(self) -> None:
        self.method = Fp8LinearMethod(serialized=False)

    def linear_method(self, names: list[str], keys: frozenset[str]) -> LinearMethod | None:
        """See QuantizationConfig.linear_method: every projection except MoE routers."""
        return None if any(_is_router(n) for n in names) else self.method


def _is_router(name: str) -> bool:
    # The router's logits choose the experts; upstream keeps it in full precision too.
    return name.endswith((".mlp.gate", ".shared_expert_gate", ".block_sparse_moe.gate"))
