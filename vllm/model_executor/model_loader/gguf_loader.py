"""Reading a GGUF file's tensors under their Hugging Face names, dequantized.

Every tensor is dequantized once at load by the `gguf` package's own routines (on CUDA as on
the CPU; docs/architecture.md §7 says why), so the model holds plain weights in the engine
dtype and runs exactly as it would from safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm.model_executor.model_loader.weight_utils import CheckpointTensor
from vllm.transformers_utils.gguf_dir import TENSOR_INDEX

# Tensor types read here: the float types, the legacy block quants and the K-quants that
# llama.cpp's usual presets (Q2_K .. Q8_0) mix.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Tensors a GGUF may carry that the model recomputes (Llama 3's rope scaling factors).
_RECOMPUTED = ("rope_freqs",)
# Per-layer Hugging Face module names of the architectures served from GGUF.
_LAYER_MODULES = (
    "input_layernorm", "post_attention_layernorm",
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)


def hf_names(architecture: str, num_layers: int) -> dict[str, str]:
    """GGUF module name (`blk.3.attn_q`) -> Hugging Face module name
    (`model.layers.3.self_attn.q_proj`) for a GGUF architecture, by the `gguf` package's own
    name table."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture)
    table = gguf.get_tensor_name_map(arch_id, num_layers)
    ours = ["model.embed_tokens", "model.norm", "lm_head"]
    ours += [f"model.layers.{i}.{m}" for i in range(num_layers) for m in _LAYER_MODULES]
    names: dict[str, str] = {}
    for name in ours:
        theirs = table.get_name(name)
        if theirs is not None:
            names[theirs] = name
    return names


def unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row order llama.cpp's converter gives Llama q/k projections.

    llama.cpp computes rotary embeddings on interleaved pairs, so its converter reorders each
    head's rows from [first halves..., second halves...] to pairs; Hugging Face's (and this
    engine's) rotary embedding wants the original order back.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def read_index(model_dir: Path) -> dict[str, Any]:
    """The tensor index the conversion wrote (gguf_dir.tensor_index). Raises ValueError
    when it is missing or malformed."""
    path = model_dir / TENSOR_INDEX
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: cannot read the GGUF tensor index {str(path)!r}: {exc}; "
                         "delete the directory to convert the file again") from None


def iterate_gguf(path: Path, hf_config: Any) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yields (Hugging Face name, dequantized float32 tensor) for every tensor of the GGUF
    file `path` (the `model.gguf` of a converted directory, beside its tensor index), one at
    a time, so at most one full-precision tensor is alive beside the model.

    Raises ValueError naming the file and tensor for an unsupported tensor type, a tensor
    the architecture has no place for, or a file shorter than its tensors.
    """
    import gguf
    from gguf.quants import dequantize

    index = read_index(path.parent)
    architecture = index["architecture"]
    names = hf_names(architecture, int(hf_config.num_hidden_layers))
    size = path.stat().st_size
    source = str(path.resolve())  # errors name the user's file, not the cache's link
    for entry in index["tensors"]:
        name, kind = entry["name"], entry["type"]
        if kind not in SUPPORTED_TYPES:
            raise ValueError(
                f"model: {source!r}: tensor {name!r} has type {kind}, which is not "
                f"supported here (supported: {', '.join(SUPPORTED_TYPES)})")
        module, _, suffix = name.rpartition(".")
        if module in _RECOMPUTED:
            continue
        if module not in names:
            raise ValueError(f"model: {source!r}: tensor {name!r} has no place in "
                             f"{hf_config.architectures[0]}")
        if entry["offset"] + entry["bytes"] > size:
            raise ValueError(f"model: {source!r} is truncated: tensor {name!r} ends past "
                             f"the end of the file")
        # A plain (read-only) view of the mapped bytes: dequantize splits the rows into many
        # small arrays, and each piece of a memmap subclass pays memmap's bookkeeping (a
        # third of SmolLM2's load time); the values are the same.
        raw = np.memmap(path, dtype=np.dtype(entry["dtype"]), mode="r",
                        offset=entry["offset"], shape=tuple(entry["shape"])).view(np.ndarray)
        weight = dequantize(raw, gguf.GGMLQuantizationType[kind])
        hf_name = f"{names[module]}.{suffix}"
        if architecture == "llama" and hf_name.endswith(
                ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = (hf_config.num_attention_heads if "q_proj" in hf_name
                     else hf_config.num_key_value_heads)
            weight = unpermute_rope(weight, heads)
        # F32 tensors come straight from the read-only memory map: copy those.
        weight = np.require(weight, np.float32, ("C_CONTIGUOUS", "WRITEABLE"))
        yield hf_name, CheckpointTensor(torch.from_numpy(weight))
