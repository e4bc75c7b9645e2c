"""Reading checkpoint tensors (whole or by slice) and making seeded random ones."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

# torch.Generator.manual_seed takes at most 64 bits.
_SEED_MASK = (1 << 64) - 1


class CheckpointTensor:
    """One checkpoint tensor that is read only as far as a loader asks.

    Wraps either an in-memory torch.Tensor or a safetensors slice handle
    (``safe_open(...).get_slice(name)``); reading a range along one dimension of the latter
    reads just that range from the file, so a tensor-parallel rank never holds a full
    matrix it keeps only a shard of.
    """

    def __init__(self, source: torch.Tensor | Any) -> None:
        self._source = source
        if isinstance(source, torch.Tensor):
            self.shape: tuple[int, ...] = tuple(source.shape)
        else:
            self.shape = tuple(int(n) for n in source.get_shape())

    def read(self) -> torch.Tensor:
        """The whole tensor (on the CPU for a file-backed one)."""
        if isinstance(self._source, torch.Tensor):
            return self._source
        # A 0-d tensor (a per-tensor scale) cannot be sliced; `...` reads it.
        return self._source[:] if self.shape else self._source[...]

    def read_range(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) ``start:start + length`` of the tensor.

        Raises ValueError for another dimension or a range outside the tensor.
        """
        if dim not in (0, 1) or dim >= len(self.shape):
            raise ValueError(f"cannot read a range along dim {dim} of shape {self.shape}")
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"range {start}:{start + length} along dim {dim} is outside shape {self.shape}"
            )
        if isinstance(self._source, torch.Tensor):
            return self._source.narrow(dim, start, length)
        index = slice(start, start + length)
        return self._source[index] if dim == 0 else self._source[:, index]


def as_checkpoint_tensor(value: torch.Tensor | CheckpointTensor) -> CheckpointTensor:
    """Wraps a plain tensor; returns a CheckpointTensor unchanged."""
    return value if isinstance(value, CheckpointTensor) else CheckpointTensor(value)


def check_shape(tensor: CheckpointTensor, expected: tuple[int, ...]) -> None:
    """Raises ValueError unless the checkpoint tensor has exactly the expected shape."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"shape {tuple(tensor.shape)} does not match expected {tuple(expected)}")


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


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yields (name, lazy handle) for every tensor in the checkpoint, one file at a time.

    Nothing is read until the consumer calls the handle's read/read_range; use each handle
    before asking for the next one (its file is closed once the iteration leaves it).
    """
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, CheckpointTensor(f.get_slice(name))


def checkpoint_keys(model_dir: Path) -> frozenset[str]:
    """The names of every tensor in the checkpoint (read from the file headers only)."""
    from safetensors import safe_open

    keys: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys.update(f.keys())
    return frozenset(keys)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers (a tensor shared by two
    names, like a tied LM head, counted once): the memory its loaded weights take."""
    seen: set[int] = set()
    total = 0
    tensors = list(model.parameters()) + [
        buf for name, buf in model.named_buffers()
        if name.rsplit(".", 1)[-1] not in _non_persistent(model, name)
    ]
    for tensor in tensors:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def _non_persistent(model: nn.Module, name: str) -> set[str]:
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return set(getattr(owner, "_non_persistent_buffers_set", ()))


def dummy_seed(seed: int, name: str) -> int:
    """The generator seed of the dummy values of parameter ``name`` under ``seed``."""
    return (seed ^ zlib.crc32(name.encode())) & _SEED_MASK


def fill_dummy_weights(
    model: nn.Module,
    seed: int,
    std: float = 0.02,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Overwrites every parameter with deterministic random values from ``seed``.

    Matrices get N(0, std); 1-D norm weights get 1 + N(0, std) so activations keep their scale;
    other 1-D parameters (biases) get N(0, std). A parameter's values depend only on the seed,
    its name and its shape (and the device type), not on which other parameters the model
    has, so a pipeline stage gets exactly the values the whole model has under the same name.
    ``aliases`` maps a parameter name to the name whose values it takes (a tied LM head on a
    stage without the embedding). A tensor-parallel shard is drawn at its own shape, so it
    is not a slice of the tp=1 values: a sharded dummy model is a different (but valid and
    rank-consistent) random model. Side effect: modifies parameters in place.
    """
    aliases = aliases or {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = aliases.get(name, name)
            gen = torch.Generator(device=param.device).manual_seed(dummy_seed(seed, source))
            noise = torch.randn(
                param.shape, generator=gen, device=param.device, dtype=torch.float32
            ).mul_(std)
            if param.dim() == 1 and source.endswith("norm.weight"):
                noise.add_(1.0)
            param.copy_(noise)
