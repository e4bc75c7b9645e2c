"""Tiny random PEFT adapters for the LoRA tests, and their merged transformers models."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(
    hf_model: torch.nn.Module,
    path: Path,
    seed: int,
    targets: list[str],
    r: int = 4,
    alpha: float = 8.0,
    use_rslora: bool = False,
) -> torch.nn.Module:
    """Saves a random PEFT LoRA adapter for `hf_model` (left unchanged) to `path` and returns
    peft's merge_and_unload() of it: the oracle model.

    PEFT starts lora_B at zero (a no-op adapter); both halves are set randomly here, scaled
    so that the adapter changes the greedy tokens.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora,
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    peft_model.save_pretrained(str(path))
    merged = peft_model.merge_and_unload()
    merged.eval()
    return merged
