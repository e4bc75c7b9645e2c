"""Gives each linear layer of a freshly built model its quantization method.

The method depends on the layer's checkpoint names (a config's ``ignore`` list, or which
layers a GPTQ checkpoint holds packed tensors for), so it is chosen here, after the model
is built and before any weight is read (docs/architecture.md §7).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.quantization.base import QuantizationConfig
from vllm.model_executor.models.llama import STACKED_PARAMS


def layer_checkpoint_names(
    module_name: str, rename: Callable[[str], str] | None = None
) -> list[str]:
    """The checkpoint module names that one of our (possibly fused) layers holds, in
    part order: ``...qkv_proj`` -> ``...q_proj``, ``...k_proj``, ``...v_proj``."""
    dotted = module_name + "."
    parts = [dotted.replace(fused, ckpt) for fused, ckpt, _ in STACKED_PARAMS
             if fused in dotted] or [dotted]
    # Renames match whole dotted fragments (".mlp."), so they apply before the dot goes.
    return [(rename(p) if rename is not None else p)[:-1] for p in parts]


def quantize_layers(model: nn.Module, config: QuantizationConfig, keys: frozenset[str]) -> None:
    """Materializes every linear layer of ``model`` (built under deferred_weights) with
    the method ``config`` gives its checkpoint names, on the current default device and
    dtype.

    Mixture-of-experts experts are materialized as the config says (FP8 or full
    precision). Raises ValueError naming the layer when its method cannot pack it, its
    fused parts disagree, or its experts are quantized in a way that is not implemented.
    """
    rename = getattr(model, "checkpoint_name", None)
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedMoE):
            module.materialize(*config.expert_scheme(layer_checkpoint_names(name, rename)[0],
                                                     keys))
            continue
        materialize = getattr(module, "materialize", None)
        if materialize is None:
            continue
        names = layer_checkpoint_names(name, rename)
        try:
            materialize(config.linear_method(names, keys))
        except ValueError as e:
            raise ValueError(f"{', '.join(names)}: {e}") from e
