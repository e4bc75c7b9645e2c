"""Per-layer FP8 KV-cache scales a checkpoint may carry, read while its weights load.

Quantization tools write one scalar per layer for keys and one for values, spelled
`model.layers.N.self_attn.k_scale` / `v_scale` (llm-compressor, ModelOpt),
`self_attn.k_proj.output_scale` / `v_proj.output_scale` (older compressed-tensors), or a
single `self_attn.kv_scale` for both (older FP8 checkpoints). They only matter under
`--kv-cache-dtype fp8`; with a full-precision cache they are read and left unused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from vllm.attention.backends.abstract import AttentionBackend
from vllm.attention.kv_cache_dtype import check_kv_scale
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor

_KV_SCALE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$"
)


def kv_scale_of(name: str) -> tuple[int, str] | None:
    """(layer index, "k", "v" or "kv") when `name` is a KV-cache scale tensor, else None."""
    match = _KV_SCALE.match(name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2) or match.group(3)


class KVScaleLoader:
    """Collects the KV-cache scales of one model's checkpoint, then gives them to the
    attention layers of this rank.

    `layers` maps the global index of each decoder layer this rank runs to its attention
    backend; `num_layers` is the model's layer count (scales of layers another pipeline
    stage runs are skipped).
    """

    def __init__(self, layers: Mapping[int, AttentionBackend], num_layers: int) -> None:
        self.layers = layers
        self.num_layers = num_layers
        # kind ("k" or "v") -> layer index -> scale
        self.scales: dict[str, dict[int, float]] = {"k": {}, "v": {}}

    def take(self, name: str, tensor: CheckpointTensor) -> bool:
        """Records `tensor` if `name` is a KV-cache scale (True), else returns False.

        Raises ValueError naming the tensor when it is not a single finite positive number
        or names a layer the model does not have."""
        found = kv_scale_of(name)
        if found is None:
            return False
        index, kind = found
        if index >= self.num_layers:
            raise ValueError(
                f"checkpoint tensor {name!r}: the model has {self.num_layers} layers"
            )
        if index not in self.layers:
            return True  # another pipeline stage's layer
        if tensor.shape not in ((), (1,)):
            raise ValueError(
                f"checkpoint tensor {name!r}: a per-tensor KV cache scale must hold one "
                f"value, got shape {tuple(tensor.shape)}"
            )
        value = check_kv_scale(
            float(tensor.read().float().reshape(())), f"checkpoint tensor {name!r}"
        )
        for k in ("k", "v") if kind == "kv" else (kind,):
            self.scales[k][index] = value
        return True

    def finish(self) -> bool:
        """Gives every layer its scales; returns whether the checkpoint had any.

        Raises ValueError naming the first missing tensor when only some of this rank's
        layers have a kind of scale (a checkpoint cut short, or layers mixed from two)."""
        for kind, found in self.scales.items():
            if found and len(found) < len(self.layers):
                missing = min(set(self.layers) - set(found))
                raise ValueError(
                    f"checkpoint is missing tensor 'model.layers.{missing}.self_attn."
                    f"{kind}_scale' (other layers have a {kind}_scale)"
                )
        for index, backend in self.layers.items():
            backend.set_kv_scales(self.scales["k"].get(index), self.scales["v"].get(index))
        return any(self.scales.values())
