"""Random EAGLE-3 heads in the original EAGLE-3 layout (`midlayer.*`, no embedding), written
with plain safetensors for engine tests; the speculators layout is written by the
speculators package itself in the head's oracle test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def write_eagle3_head(path: Path, target: Any, *, aux_layer_ids: list[int],
                      draft_vocab: list[int] | None = None, seed: int = 0,
                      scale: float = 1.0, echo: Path | None = None) -> Path:
    """Writes a one-layer head for the target whose Hugging Face config is `target` into
    `path` and returns it. `draft_vocab` lists the target ids it drafts over (None: all, no
    d2t); `scale` multiplies the random weights of the attention and MLP outputs (0: the
    layer adds nothing to the hidden state).

    `echo` (the target's checkpoint directory, its last auxiliary layer the target's last
    output): fc passes that state through and the final norm and LM head are the target's,
    so with a small `scale` the head mostly drafts the target's own prediction at the
    position before, that is the newest token again: drafts that runs of one token keep."""
    gen = torch.Generator().manual_seed(seed)
    h, heads = target.hidden_size, target.num_attention_heads
    kv_heads = getattr(target, "num_key_value_heads", heads)
    head_dim = getattr(target, "head_dim", None) or h // heads
    inter = target.intermediate_size
    vocab = target.vocab_size
    ids = draft_vocab if draft_vocab is not None else list(range(vocab))

    def rand(*shape: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * gain / shape[-1] ** 0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    tensors = {
        "fc.weight": rand(h, len(aux_layer_ids) * h),
        "midlayer.hidden_norm.weight": norm(h), "midlayer.input_layernorm.weight": norm(h),
        "midlayer.post_attention_layernorm.weight": norm(h),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * head_dim, gain=scale),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter, gain=scale),
        "norm.weight": norm(h), "lm_head.weight": rand(len(ids), h),
    }
    if echo is not None:
        from safetensors import safe_open

        with safe_open(str(echo / "model.safetensors"), "pt") as f:
            names = set(f.keys())
            head = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
            tensors["lm_head.weight"] = f.get_tensor(head)[ids].float()
            tensors["norm.weight"] = f.get_tensor("model.norm.weight").float()
        fc = torch.zeros(h, len(aux_layer_ids) * h)
        fc[:, -h:] = torch.eye(h)
        tensors["fc.weight"] = fc
    if draft_vocab is not None:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["d2t"] = torch.tensor(ids, dtype=torch.int64) - torch.arange(len(ids))
        tensors["t2d"] = t2d
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": getattr(target, "rope_theta", None) or 10000.0,
        "max_position_embeddings": 2048, "vocab_size": vocab, "draft_vocab_size": len(ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids},
    }
    (path / "config.json").write_text(json.dumps(config))
    return path
