"""Reads and checks a LoRA adapter directory as PEFT writes it.

A directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, ...) and
`adapter_model.safetensors`, whose tensors are named like
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (A: [r, in]) and
`...q_proj.lora_B.weight` (B: [out, r]). The delta of a targeted projection is
``scale * x A^T B^T`` with scale ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
`use_rslora`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm.exceptions import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target, under the block that holds each.
TARGET_MODULES: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass
class LoRAAdapter:
    """One adapter's weights, on the host in float32.

    ``weights[(layer, module)] = (A [rank, in], B [out, rank])`` with the scale folded into B.
    """

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) features of each targetable projection of a dense Llama-family config."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _bad(path: Path, message: str) -> InvalidRequestError:
    return InvalidRequestError("lora_request", f"LoRA adapter {str(path)!r}: {message}")


def _read_config(directory: Path, max_rank: int) -> tuple[int, float]:
    """Returns (rank, scale) from adapter_config.json; raises InvalidRequestError."""
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise _bad(path, "file not found") from None
    except (OSError, ValueError) as e:
        raise _bad(path, f"unreadable ({e})") from None
    if not isinstance(config, dict):
        raise _bad(path, "must hold a JSON object")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _bad(path, f"key 'r' must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _bad(path, f"key 'lora_alpha' must be a number, got {alpha!r}")
    if rank > max_rank:
        raise _bad(path, f"key 'r' is {rank}, above --max-lora-rank {max_rank}")
    # Features that change the math beyond A and B: refused rather than silently ignored.
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _bad(path, f"key {key!r} (per-module ranks or alphas) is not supported")
    if config.get("bias", "none") != "none":
        raise _bad(path, f"key 'bias' is {config['bias']!r}; only 'none' is supported")
    if config.get("modules_to_save"):
        raise _bad(path, "key 'modules_to_save' is not supported")
    if config.get("use_dora"):
        raise _bad(path, "key 'use_dora' (DoRA) is not supported")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise _bad(path, "file not found")
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise _bad(path, f"not a readable safetensors file ({e})") from None


def load_adapter(directory: str, hf_config: Any, max_rank: int) -> LoRAAdapter:
    """Reads and checks the PEFT adapter in `directory` for a model with `hf_config`.

    Raises InvalidRequestError (a ValueError) naming the file, and the key where one is at
    fault, for: a missing or corrupt file, a rank above `max_rank`, a tensor for a module
    this engine cannot adapt (or a layer the model lacks), a wrong shape, an A without its B
    (or the reverse), or no tensors at all.
    """
    root = Path(directory)
    rank, scale = _read_config(root, max_rank)
    path = root / WEIGHTS_FILE
    tensors = _read_tensors(path)
    shapes = module_shapes(hf_config)
    num_layers = hf_config.num_hidden_layers
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise _bad(path, f"tensor {key!r} is not a LoRA A/B weight of a decoder layer")
        layer, block, module, half = int(match[1]), match[2], match[3], match[4]
        if TARGET_MODULES.get(module) != block:
            raise _bad(path, f"tensor {key!r} targets {block}.{module}; adapters may target "
                             f"only {', '.join(TARGET_MODULES)}")
        if layer >= num_layers:
            raise _bad(path, f"tensor {key!r} is for layer {layer}; the model has "
                             f"{num_layers} layers")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if half == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise _bad(path, f"tensor {key!r} has shape {list(tensor.shape)}, expected "
                             f"{list(want)} (r={rank})")
        halves.setdefault((layer, module), {})[half] = tensor.to(torch.float32)
    if not halves:
        raise _bad(path, "holds no LoRA tensors")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            key = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
            raise _bad(path, f"tensor {key}.lora_{missing}.weight is missing")
        weights[(layer, module)] = (pair["A"].contiguous(), (pair["B"] * scale).contiguous())
    return LoRAAdapter(rank=rank, weights=weights)
