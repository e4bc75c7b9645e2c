"""Builds a model from a ModelConfig and fills its weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from vllm.attention.selector import get_attn_backend_cls
from vllm.config import ModelConfig
from vllm.distributed.parallel_state import ParallelContext
from vllm.model_executor.layers.linear import deferred_weights
from vllm.model_executor.model_loader.gguf_loader import iterate_gguf
from vllm.model_executor.model_loader.quantize import quantize_layers
from vllm.model_executor.model_loader.weight_utils import (
    checkpoint_keys,
    fill_dummy_weights,
    iterate_safetensors,
)
from vllm.model_executor.models.registry import get_model_class


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Creating parameters directly in the target dtype avoids a full-precision copy of the model.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model(model_config: ModelConfig, parallel: ParallelContext | None = None) -> nn.Module:
    """Returns this rank's part of the model for model_config in eval mode, on its device,
    in its dtype.

    ``parallel`` places the rank in the tensor x pipeline layout (None: a single rank, the
    whole model). load_format "auto"/"hf"/"safetensors" reads the checkpoint in model_dir, only
    the slices this rank keeps; "auto"/"gguf" on a GGUF model dequantizes its tensors (see
    gguf_loader.py); "dummy" fills seeded random weights from model_config.seed
    (see fill_dummy_weights). With model_config.quant_config, each linear layer gets its
    quantization method before loading (see quantize_layers). Raises ValueError for an
    unsupported architecture, a missing, unknown or misshapen checkpoint tensor, a model
    that does not split into the layout, an unknown load format, or a quantized model
    that cannot be loaded (dummy weights, a layer the format cannot pack).
    """
    hf_config = model_config.hf_config
    model_cls = get_model_class(list(getattr(hf_config, "architectures", None) or []))
    backend_cls = get_attn_backend_cls(model_config.attention_backend, model_config.device)
    parallel = parallel or ParallelContext.single()
    quant_config = model_config.quant_config
    if quant_config is not None and model_config.load_format == "dummy":
        raise ValueError(f"--load-format dummy cannot be combined with quantization "
                         f"({quant_config.name}): random weights have no packed form")
    with _default_dtype(model_config.torch_dtype), torch.device(model_config.device):
        with deferred_weights(quant_config is not None):
            model = model_cls(hf_config, backend_cls, parallel)
        if quant_config is not None:
            quantize_layers(model, quant_config, checkpoint_keys(model_config.model_dir))
    if model_config.load_format == "dummy":
        aliases = model.weight_aliases() if hasattr(model, "weight_aliases") else {}
        fill_dummy_weights(model, model_config.seed, aliases=aliases)
    elif model_config.load_format in ("auto", "gguf") and model_config.gguf_file is not None:
        model.load_weights(iterate_gguf(model_config.gguf_file, hf_config))
    elif model_config.load_format in ("auto", "hf", "safetensors"):
        model.load_weights(iterate_safetensors(model_config.model_dir))
    else:
        raise ValueError(
            f"load_format: {model_config.load_format!r} is not one of auto, hf, safetensors, "
            "gguf, dummy"
        )
    return model.eval()
