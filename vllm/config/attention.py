"""`attention_config` (upstream vLLM's AttentionConfig) mapped onto this engine's attention
backends: `backend` picks torch or triton; upstream's other options tune kernels this engine
does not have, so each is accepted only at upstream's default (it then asks for nothing)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

# Upstream's backend names (case-insensitive) and ours -> the backend that runs here.
BACKEND_NAMES = {
    "auto": "auto",
    "torch": "torch",
    "torch_sdpa": "torch",
    "cpu_attn": "torch",
    "triton": "triton",
    "triton_attn": "triton",
}
# Upstream's other AttentionConfig options and their defaults (FlashAttention, FlashInfer,
# cuDNN and TensorRT-LLM switches).
UPSTREAM_DEFAULTS: dict[str, Any] = {
    "flash_attn_version": None,
    "use_prefill_decode_attention": False,
    "flash_attn_max_num_splits_for_cuda_graph": 32,
    "use_cudnn_prefill": False,
    "use_trtllm_ragged_deepseek_prefill": False,
    "use_trtllm_attention": None,
    "disable_flashinfer_prefill": False,
    "disable_flashinfer_q_quantization": False,
}


@dataclass
class AttentionConfig:
    """Upstream's `AttentionConfig`, as far as it applies here: `backend` is TRITON_ATTN
    (or triton), TORCH_SDPA / CPU_ATTN (or torch), auto, or None (the engine's choice)."""

    backend: str | None = None


def _as_options(config: object) -> dict[str, Any]:
    """`config` (a dict, a dataclass such as AttentionConfig, or an object with
    attributes) as a dict of its options. Raises ValueError for anything else."""
    if isinstance(config, dict):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    names = ("backend", *UPSTREAM_DEFAULTS)
    if any(hasattr(config, name) for name in names):
        return {name: getattr(config, name) for name in names if hasattr(config, name)}
    raise ValueError(
        f"attention_config: must be a dict or an AttentionConfig, got {type(config).__name__}")


def _backend_name(value: object) -> str:
    """The text of a backend value: an enum member's name (upstream's
    AttentionBackendEnum), or the string itself."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, str):
        return value
    raise ValueError(f"attention_config.backend: must be a backend name, got {value!r}")


def resolve_attention_backend(config: object | None, attention_backend: str = "auto") -> str:
    """The attention backend ("auto", "torch" or "triton") that `attention_config` and
    `--attention-backend` ask for together.

    Raises ValueError naming the key: an unknown key, a backend this engine does not have
    (FLASH_ATTN, FLASHINFER, ...), an upstream kernel option set away from its default,
    or a backend that disagrees with --attention-backend.
    """
    if config is None:
        return attention_backend
    options = _as_options(config)
    known = {"backend", *UPSTREAM_DEFAULTS}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"attention_config.{unknown[0]}: unknown option; known: "
                         f"{', '.join(sorted(known))}")
    for key, default in UPSTREAM_DEFAULTS.items():
        if key in options and options[key] != default:
            raise ValueError(
                f"attention_config.{key}: {options[key]!r} is not supported here: it tunes "
                "FlashAttention, FlashInfer, cuDNN or TensorRT-LLM kernels, and this "
                "engine's attention backends are torch and triton (leave it at "
                f"{default!r})")
    value = options.get("backend")
    if value is None:
        return attention_backend
    name = _backend_name(value)
    chosen = BACKEND_NAMES.get(name.lower())
    if chosen is None:
        raise ValueError(
            f"attention_config.backend: {name!r} is not available here; use TRITON_ATTN "
            "(triton), TORCH_SDPA or CPU_ATTN (torch), or auto")
    if attention_backend != "auto" and chosen not in ("auto", attention_backend):
        raise ValueError(
            f"attention_config.backend {name!r} and --attention-backend "
            f"{attention_backend} disagree")
    return attention_backend if chosen == "auto" else chosen
