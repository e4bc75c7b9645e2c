"""The tensor files of an EAGLE-3 draft head: which tensors it holds, their shapes, and reading one.

Heads ship as safetensors (one file, or shards with an index) or, in the original EAGLE-3
release, as `pytorch_model.bin` (a pickled state dict, read with `weights_only` and memory
mapped, so listing it does not read the tensors). Every failure is a ValueError naming the
file, so a corrupt head is a startup error rather than a traceback in a worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

FLAG = "--speculative-config.model"


@dataclass(frozen=True)
class TensorRef:
    """Where one checkpoint tensor lies and what shape it has."""

    path: Path
    name: str
    shape: tuple[int, ...]


def _indexed(model_dir: Path, index_name: str) -> list[Path] | None:
    """The shard files an index names (None without the index)."""
    index = model_dir / index_name
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{FLAG}: malformed {index_name} in {model_dir}: {e}") from e
    for name in files:
        if not (model_dir / name).is_file():
            raise ValueError(f"{FLAG}: {index_name} names missing file {name}")
    return [model_dir / name for name in files]


def weight_files(model_dir: Path) -> list[Path]:
    """The head's weight files: safetensors first, else pytorch_model.bin. Raises ValueError
    when there is none."""
    files = _indexed(model_dir, "model.safetensors.index.json")
    if files is None:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        files = _indexed(model_dir, "pytorch_model.bin.index.json") or []
    if not files and (model_dir / "pytorch_model.bin").is_file():
        files = [model_dir / "pytorch_model.bin"]
    if not files:
        raise ValueError(f"{FLAG}: no *.safetensors or pytorch_model.bin weights in {model_dir}")
    return files


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a truncated zip, a foreign pickle, ...
        raise ValueError(f"{FLAG}: cannot read {path.name}: {e}") from e
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(f"{FLAG}: {path.name} is not a state dict of named tensors")
    return state


def list_tensors(model_dir: Path) -> dict[str, TensorRef]:
    """Every tensor of the head by its name in the checkpoint, read from the file headers
    (safetensors) or a memory map (pytorch_model.bin). Raises ValueError naming the file
    that cannot be read or a tensor named twice."""
    from safetensors import safe_open

    found: dict[str, TensorRef] = {}
    for path in weight_files(model_dir):
        shapes: dict[str, tuple[int, ...]] = {}
        if path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        shapes[name] = tuple(int(n) for n in f.get_slice(name).get_shape())
            except Exception as e:  # SafetensorError: a bad header, a short file
                raise ValueError(f"{FLAG}: cannot read {path.name}: {e}") from e
        else:
            shapes = {k: tuple(v.shape) for k, v in _load_bin(path).items()}
        for name, shape in shapes.items():
            if name in found:
                raise ValueError(f"{FLAG}: tensor {name!r} is in both "
                                 f"{found[name].path.name} and {path.name}")
            found[name] = TensorRef(path, name, shape)
    return found


def read_tensor(ref: TensorRef) -> torch.Tensor:
    """The tensor's values on the CPU. Raises ValueError naming the file when they cannot be
    read (a header that promises more bytes than the file has)."""
    if ref.path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(ref.path), framework="pt", device="cpu") as f:
                return f.get_tensor(ref.name)
        except Exception as e:
            raise ValueError(f"{FLAG}: cannot read {ref.name!r} from {ref.path.name}: {e}") from e
    return _load_bin(ref.path)[ref.name]
