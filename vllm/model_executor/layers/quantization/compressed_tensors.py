"""compressed-tensors checkpoints (llm-compressor's output): ``quant_method ==
"compressed-tensors"`` with ``config_groups`` of targets and schemes and an ``ignore``
list. Supported schemes: FP8 weights with per-channel or per-tensor scales and dynamic
(or no) FP8 activations (float-quantized / naive-quantized), and 4-bit integer weights
with group or channel scales, no activation quantization (pack-quantized W4A16)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig, Shard
from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
from vllm.model_executor.layers.quantization.int4 import PACKED, PackedInt4Method, ParamSpec
from vllm.model_executor.layers.quantization.packing import INT4_PER_INT32, Axis, unpack_int4
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor

# Unsigned storage of a signed 4-bit value adds this offset.
_INT4_OFFSET = 8


class CompressedInt4Method(PackedInt4Method):
    """pack-quantized W4A16: ``weight_packed`` [out, in / 8] int32, ``weight_scale``
    [out, groups], ``weight_shape`` (the full [out, in]) and, when asymmetric,
    ``weight_zero_point`` [out / 8, groups] packed along the rows."""

    def __init__(self, group_size: int | None, symmetric: bool) -> None:
        super().__init__(group_size)
        self.symmetric = symmetric

    def specs(self, in_full: int) -> dict[str, ParamSpec]:
        """See PackedInt4Method.specs."""
        groups = self.group_axis(in_full)
        hint = f"{groups.what} from quantization_config"
        specs: dict[str, ParamSpec] = {
            "weight_packed": ((Axis("out"), Axis("in", INT4_PER_INT32, PACKED)),
                              torch.int32, "4-bit values packed 8 per int32 along the input"),
            "weight_scale": ((Axis("out"), groups), None, hint),
            "weight_shape": ((Axis("fixed", 2),), torch.int64, "the unpacked [out, in]"),
        }
        if not self.symmetric:
            specs["weight_zero_point"] = (
                (Axis("out", INT4_PER_INT32, PACKED), groups), torch.int32, hint)
        return specs

    def load(self, layer: nn.Module, name: str, tensor: CheckpointTensor,
             shard: Shard) -> None:
        """See LinearMethod.load; ``weight_shape`` is checked, not kept per part."""
        if name == "weight_shape":
            got = [int(v) for v in tensor.read().reshape(-1).tolist()]
            if got != [shard.out_full, shard.in_full]:
                raise ValueError(
                    f"weight_shape {got} does not match the layer's [{shard.out_full}, "
                    f"{shard.in_full}]"
                )
            with torch.no_grad():
                layer.weight_shape.copy_(torch.tensor(layer.packed_sizes))
            return
        super().load(layer, name, tensor, shard)

    def kernel_args(self, layer: nn.Module) -> dict[str, Any] | None:
        """See PackedInt4Method.kernel_args: words [out, in / 8], scales [out, groups]."""
        w, s = layer.weight_packed, layer.weight_scale
        out_size, in_size = layer.packed_sizes
        args: dict[str, Any] = {
            "words": w, "word_strides": (w.stride(0), w.stride(1)),
            "scales": s, "scale_strides": (s.stride(0), s.stride(1)),
            "out_size": out_size, "group_size": self.group_size or in_size,
            # Both the values and the zero points are stored offset by 8, which cancels.
            "zero_bias": _INT4_OFFSET if self.symmetric else 0,
        }
        if not self.symmetric:
            z = layer.weight_zero_point
            args.update(zeros=z, zero_strides=(z.stride(0), z.stride(1)))
        return args

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """See PackedInt4Method.dequantize."""
        q = unpack_int4(layer.weight_packed, 1) - _INT4_OFFSET
        groups = self.group_of_columns(layer)
        if not self.symmetric:
            zero = unpack_int4(layer.weight_zero_point, 0) - _INT4_OFFSET
            q = q - zero[:, groups]
        return q.to(dtype) * layer.weight_scale.to(dtype)[:, groups]


def _matches(name: str, pattern: str) -> bool:
    # "re:" patterns are regular expressions matched from the start of the module name;
    # "Linear" is the class every projection here is; others name a module (or its end).
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or name == pattern or name.endswith("." + pattern)


def _fp8_method(key: str, weights: dict[str, Any], acts: dict[str, Any] | None) -> LinearMethod:
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"{key}.weights.strategy: {strategy!r} is not supported for FP8 "
                         "weights (channel or tensor)")
    per_token = True
    if acts is not None:
        if acts.get("type") != "float" or acts.get("num_bits") != 8:
            raise ValueError(f"{key}.input_activations: only FP8 activations go with FP8 "
                             "weights here")
        if not acts.get("dynamic"):
            raise ValueError(f"{key}.input_activations: static activation scales "
                             "(input_scale) are not supported; use dynamic: true")
        per_token = acts.get("strategy") == "token"
    return Fp8LinearMethod(serialized=True, per_tensor=strategy == "tensor",
                           per_token=per_token)


def _int4_method(key: str, weights: dict[str, Any], acts: dict[str, Any] | None) -> LinearMethod:
    if acts is not None:
        raise ValueError(f"{key}.input_activations: 4-bit weights are supported only "
                         "without activation quantization (W4A16)")
    strategy = weights.get("strategy")
    group_size = weights.get("group_size")
    if strategy == "group":
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"{key}.weights.group_size: {group_size!r} must be a positive "
                             "integer for strategy 'group'")
        return CompressedInt4Method(group_size, bool(weights.get("symmetric", True)))
    if strategy == "channel":
        return CompressedInt4Method(None, bool(weights.get("symmetric", True)))
    raise ValueError(f"{key}.weights.strategy: {strategy!r} is not supported for 4-bit "
                     "weights (group or channel)")


def scheme_method(key: str, group: dict[str, Any], default_format: str | None) -> LinearMethod:
    """The linear method of one ``config_groups`` entry (``key`` names it in errors).

    Raises ValueError naming the field for a scheme this engine does not run.
    """
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{key}.weights: missing (weight quantization is required)")
    acts = group.get("input_activations")
    fmt = group.get("format") or default_format
    kind, bits = weights.get("type"), weights.get("num_bits")
    if kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        return _fp8_method(key, weights, acts)
    if kind == "int" and bits == 4 and fmt == "pack-quantized":
        return _int4_method(key, weights, acts)
    raise ValueError(
        f"{key}: {kind} {bits}-bit weights in format {fmt!r} are not supported; supported: "
        "FP8 (float-quantized) and 4-bit int weight-only (pack-quantized)"
    )


class CompressedTensorsConfig(QuantizationConfig):
    """A compressed-tensors ``quantization_config``: schemes by target, minus ``ignore``."""

    name = "compressed-tensors"

    def __init__(self, config: dict[str, Any]) -> None:
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups: missing or empty")
        fmt = config.get("format")
        self.schemes: list[tuple[list[str], LinearMethod]] = []
        for key, group in groups.items():
            where = f"quantization_config.config_groups.{key}"
            targets = group.get("targets") if isinstance(group, dict) else None
            if not isinstance(targets, list) or not targets:
                raise ValueError(f"{where}.targets: missing or empty")
            self.schemes.append(([str(t) for t in targets], scheme_method(where, group, fmt)))
        self.ignore = [str(p) for p in config.get("ignore") or []]

    def _method_of(self, name: str) -> LinearMethod | None:
        if any(_matches(name, p) for p in self.ignore):
            return None
        for targets, method in self.schemes:
            if any(_matches(name, t) for t in targets):
                return method
        return None

    def expert_scheme(self, prefix: str, keys: frozenset[str]) -> tuple[bool, bool]:
        """See QuantizationConfig.expert_scheme: FP8 experts are supported (every expert
        projection with the same scheme); 4-bit experts are refused."""
        marker = prefix + "."
        names = sorted({k[: -len(".weight")] for k in keys
                        if k.startswith(marker) and k.endswith(".weight")})
        methods = {id(m): m for m in (self._method_of(n) for n in names)}
        if len(methods) > 1:
            raise ValueError(f"quantization_config: the experts under {prefix} are quantized "
                             "differently (config_groups / ignore)")
        method = next(iter(methods.values()), None)
        if method is None:
            return False, False
        if not isinstance(method, Fp8LinearMethod):
            raise ValueError(f"quantization_config: {prefix}: only FP8 mixture-of-experts "
                             "experts are supported, not 4-bit ones")
        return True, method.per_tensor

    def linear_method(self, names: list[str], keys: frozenset[str]) -> LinearMethod | None:
        """See QuantizationConfig.linear_method."""
        methods = [self._method_of(n) for n in names]
        if any(m is not methods[0] for m in methods):
            raise ValueError(
                f"quantization_config: {', '.join(names)} are fused into one layer here but "
                "are quantized differently (config_groups / ignore)"
            )
        return methods[0]
