"""Reading checkpoint tensors and making seeded random ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn


def safetensors_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in load order.

    Uses model.safetensors.index.json when present, else model.safetensors, else every
    *.safetensors file. Raises ValueError if there is none or the index names a missing file.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"model: malformed {index}: {e}") from e
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ValueError(f"model: {index.name} names missing shard {f.name}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_dir}")
    return files


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, CPU tensor) for every tensor in the checkpoint, one at a time."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def fill_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Overwrites every parameter with deterministic random values from ``seed``.

    Matrices get N(0, std); 1-D norm weights get 1 + N(0, std) so activations keep their scale;
    other 1-D parameters (biases) get N(0, std). The same seed gives the same weights on the
    same device type. Side effect: modifies parameters in place.
    """
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            device = param.device
            if device not in gens:
                gens[device] = torch.Generator(device=device).manual_seed(seed)
            noise = torch.randn(
                param.shape, generator=gens[device], device=device, dtype=torch.float32
            ).mul_(std)
            if param.dim() == 1 and name.endswith("norm.weight"):
                noise.add_(1.0)
            param.copy_(noise)
