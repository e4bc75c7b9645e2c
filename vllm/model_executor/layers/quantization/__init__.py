"""Quantized linear layers: which format a model uses and how its layers hold and
multiply packed weights (docs/architecture.md §7)."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    Shard,
)

# --quantization values; the Marlin names upstream users type select the same formats.
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}

__all__ = ["QUANTIZATION_METHODS", "LinearMethod", "QuantizationConfig", "Shard",
           "get_quantization_config"]


def _checkpoint_config(hf_config: Any) -> dict[str, Any] | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        to_dict = getattr(config, "to_dict", None)
        config = to_dict() if to_dict is not None else None
    if not isinstance(config, dict):
        raise ValueError("config.json: quantization_config must be an object")
    return config


def get_quantization_config(hf_config: Any, requested: str | None) -> QuantizationConfig | None:
    """The quantization of a model: the checkpoint's ``quantization_config`` (config.json),
    or ``requested`` (--quantization) for a full-precision checkpoint; None for neither.

    Raises ValueError naming the flag or the config key when ``requested`` is unknown or
    disagrees with the checkpoint, when a full-precision checkpoint is given a format that
    needs quantized tensors, or when the checkpoint's scheme is not supported.
    """
    if requested is not None:
        requested = _ALIASES.get(requested, requested)
        if requested not in QUANTIZATION_METHODS:
            raise ValueError(f"--quantization: {requested!r} is not one of "
                             f"{', '.join(QUANTIZATION_METHODS)}")
    config = _checkpoint_config(hf_config)
    if config is None:
        if requested is None:
            return None
        if requested != "fp8":
            raise ValueError(
                f"--quantization {requested}: the checkpoint's config.json has no "
                "quantization_config; only fp8 quantizes a full-precision checkpoint at load"
            )
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config

        return Fp8Config()
    method = str(config.get("quant_method", "")).lower()
    method = _ALIASES.get(method, method)
    if requested is not None and requested != method:
        raise ValueError(
            f"--quantization {requested} disagrees with the checkpoint's "
            f"quantization_config.quant_method {method!r} (config.json); omit the flag or "
            f"pass --quantization {method}"
        )
    if method == "compressed-tensors":
        from vllm.model_executor.layers.quantization.compressed_tensors import (
            CompressedTensorsConfig,
        )

        return CompressedTensorsConfig(config)
    if method == "gptq":
        from vllm.model_executor.layers.quantization.gptq import GptqConfig

        return GptqConfig(config)
    if method == "awq":
        from vllm.model_executor.layers.quantization.awq import AwqConfig

        return AwqConfig(config)
    raise ValueError(
        f"quantization_config.quant_method: {method!r} (config.json) is not supported; "
        "supported: compressed-tensors, gptq, awq (and --quantization fp8 on a "
        "full-precision checkpoint)"
    )
