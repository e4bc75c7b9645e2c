"""Reading packed checkpoint tensors: the slice a rank keeps, and 4-bit unpacking.

A packed tensor's dimensions each follow the weight's output rows or input columns,
``pack`` of them per stored element (8 int4 values per int32, or ``group_size`` columns per
scale), so a rank's rows or columns map to a range of the stored tensor when they are
aligned to the packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.model_executor.layers.quantization.base import Shard
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor

# Values per int32 word of a 4-bit packing.
INT4_PER_INT32 = 8


@dataclass(frozen=True)
class Axis:
    """One dimension of a packed tensor.

    ``kind`` is "out" (follows the output rows), "in" (follows the input columns),
    "all_in" (follows the input columns but every rank keeps all of them) or "fixed"
    (``pack`` is then the dimension's size). ``pack`` weight rows/columns share one stored
    element; ``what`` names the packing for error messages.
    """

    kind: str
    pack: int = 1
    what: str = ""


def _extent(axis: Axis, full: int, key: str) -> int:
    if full % axis.pack:
        raise ValueError(
            f"{full} {'rows' if axis.kind == 'out' else 'columns'} are not a multiple of "
            f"{axis.what or axis.pack} ({axis.pack}) for {key}"
        )
    return full // axis.pack


def full_shape(layout: tuple[Axis, ...], shard: Shard, key: str) -> tuple[int, ...]:
    """The shape the whole checkpoint tensor must have. Raises ValueError when the weight's
    size is not a multiple of a packing."""
    shape = []
    for axis in layout:
        if axis.kind == "fixed":
            shape.append(axis.pack)
        else:
            full = shard.out_full if axis.kind == "out" else shard.in_full
            shape.append(_extent(axis, full, key))
    return tuple(shape)


def local_shape(layout: tuple[Axis, ...], out_size: int, in_size: int, in_full: int,
                key: str) -> tuple[int, ...]:
    """The shape of the parameter that holds a local weight [out_size, in_size]."""
    shape = []
    for axis in layout:
        if axis.kind == "fixed":
            shape.append(axis.pack)
        elif axis.kind == "out":
            shape.append(_extent(axis, out_size, key))
        elif axis.kind == "in":
            shape.append(_extent(axis, in_size, key))
        else:
            shape.append(_extent(axis, in_full, key))
    return tuple(shape)


def _aligned(start: int, length: int, axis: Axis, key: str) -> tuple[int, int]:
    if start % axis.pack or length % axis.pack:
        raise ValueError(
            f"{key}: the tensor-parallel slice {start}:{start + length} is not aligned to "
            f"the {axis.what or 'packing'} ({axis.pack}); use a tensor-parallel size that "
            "splits it evenly"
        )
    return start // axis.pack, length // axis.pack


def read_shard(
    param: torch.Tensor,
    tensor: CheckpointTensor,
    layout: tuple[Axis, ...],
    shard: Shard,
    key: str,
    hint: str = "",
) -> None:
    """Copies the slice of a packed checkpoint tensor a rank keeps into its place in
    ``param`` (cast to param's dtype).

    Raises ValueError naming ``key`` for a wrong full shape (``hint`` says what sets it,
    e.g. the group size), a slice that the packing cannot split, or a tensor whose dtype
    cannot hold what param holds (floats for packed integers, anything but FP8 for FP8).
    """
    expected = full_shape(layout, shard, key)
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"shape {tuple(tensor.shape)} does not match expected {expected}"
            + (f" ({hint})" if hint else "")
        )
    source: torch.Tensor | None = None
    target = param.data
    for dim, axis in enumerate(layout):
        if axis.kind == "out":
            start, length = _aligned(shard.out_start, shard.out_len, axis, key)
            offset, _ = _aligned(shard.out_offset, 0, axis, key)
            target = target.narrow(dim, offset, length)
        elif axis.kind == "in":
            start, length = _aligned(shard.in_start, shard.in_len, axis, key)
        else:
            continue
        if length != expected[dim]:
            # At most one dimension is sliced (rows of a column-parallel layer, columns of
            # a row-parallel one); read only that range from the file.
            if source is not None:
                source = source.narrow(dim, start, length)
            elif dim in (0, 1):
                source = tensor.read_range(dim, start, length)
            else:
                source = tensor.read().narrow(dim, start, length)
    if source is None:
        source = tensor.read()
    _check_dtype(source.dtype, param.dtype)
    with torch.no_grad():
        target.copy_(source)


def _check_dtype(got: torch.dtype, want: torch.dtype) -> None:
    # Casting would silently turn a full-precision tensor into garbage codes.
    if want == torch.float8_e4m3fn and got != want:
        raise ValueError(f"dtype {got} is not the FP8 (float8_e4m3fn) the format stores")
    if not want.is_floating_point and got.is_floating_point:
        raise ValueError(f"dtype {got} is not the packed integers the format stores")


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Unpacks int32 words holding 8 unsigned 4-bit values each along ``dim`` (value i of
    a word in bits 4i..4i+3, the first value in the lowest bits) into int32 values 0..15,
    so that dimension grows 8-fold."""
    moved = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    values = (moved.unsqueeze(-1) >> shifts).bitwise_and_(0xF)
    return values.flatten(-2).movedim(-1, dim)
