"""The element type of the paged KV cache (`--kv-cache-dtype`) and its FP8 quantization.

`auto` stores keys and values in the model's dtype. `fp8` (an alias of `fp8_e4m3`) stores
them as float8_e4m3fn with one scale per layer for keys and one for values: a write divides
by the scale and saturates to the e4m3 range (±448), a read converts back and multiplies by
the scale (backends fold it into the score scale and the output instead, see
docs/architecture.md §6). Scales are 1.0 unless the checkpoint carries them.
"""

from __future__ import annotations

import math

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_DTYPE = torch.float8_e4m3fn
# Largest finite e4m3 magnitude: writes saturate here rather than overflow to NaN.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def check_kv_cache_dtype(name: object) -> str:
    """Returns `name` when it is a supported --kv-cache-dtype. Raises ValueError naming the
    flag and the supported values otherwise."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype: {name!r} is not supported; choose one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    return str(name)


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a cache spelled `name` (see check_kv_cache_dtype) for a model
    running in `model_dtype`. Raises ValueError for an unsupported name."""
    if check_kv_cache_dtype(name) == "auto":
        return model_dtype
    return FP8_DTYPE


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds quantized values (reads must rescale them)."""
    return dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale, saturated to ±FP8_MAX and rounded to float8_e4m3fn (a new tensor)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def check_kv_scale(value: float, what: str) -> float:
    """Returns `value` as a float when it is a usable scale (finite and positive). Raises
    ValueError naming `what` (a flag or a checkpoint tensor) otherwise."""
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{what}: a KV cache scale must be finite and positive, got {value}")
    return value


def check_fp8_cache_device(device: torch.device, needed: tuple[int, int] | None) -> None:
    """Raises ValueError naming --kv-cache-dtype when `device` is a CUDA GPU below the
    compute capability `needed` by the attention backend for an FP8 cache (None, or a
    device other than CUDA: nothing to check)."""
    if needed is None or torch.device(device).type != "cuda":
        return
    have = torch.cuda.get_device_capability(device)
    if tuple(have) < needed:
        raise ValueError(
            f"--kv-cache-dtype fp8: this attention backend needs a GPU of compute capability "
            f"{needed[0]}.{needed[1]} or newer for float8 e4m3, this one is "
            f"{have[0]}.{have[1]} (use --attention-backend torch, or --kv-cache-dtype auto)"
        )
