"""What every quantization format provides: a config read from the checkpoint and a
linear method that owns a layer's packed parameters.

A linear layer (layers/linear.py) built while quantization is on declares its size but no
weight; the loader then asks the config for each layer's method by the layer's checkpoint
names, and the method creates the packed parameters, fills them from checkpoint tensors
(only this rank's slice) and computes ``x W^T`` from them (docs/architecture.md §7).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from vllm.model_executor.model_loader.weight_utils import CheckpointTensor


@dataclass(frozen=True)
class Shard:
    """Which part of a full checkpoint matrix [out_full, in_full] a layer keeps, and where.

    Rows ``out_start:out_start + out_len`` land at rows ``out_offset:out_offset + out_len``
    of the layer's (possibly fused) output; columns ``in_start:in_start + in_len`` are the
    layer's whole input. A column-parallel layer slices rows, a row-parallel one columns.
    """

    out_full: int
    out_start: int
    out_len: int
    out_offset: int
    in_full: int
    in_start: int
    in_len: int

    @staticmethod
    def whole(out_size: int, in_size: int) -> Shard:
        """The shard of a layer that keeps the whole matrix."""
        return Shard(out_size, 0, out_size, 0, in_size, 0, in_size)


class LinearMethod(ABC):
    """How one quantization format stores and multiplies one linear layer's weight."""

    @abstractmethod
    def create(self, layer: nn.Module, out_size: int, in_size: int, in_full: int) -> None:
        """Registers the layer's packed parameters for a local weight [out_size, in_size]
        of a full one with ``in_full`` columns (uninitialized: loading fills them).
        Raises ValueError when the sizes cannot be packed (not a multiple of the packing
        or group size)."""

    @abstractmethod
    def load(self, layer: nn.Module, name: str, tensor: CheckpointTensor, shard: Shard) -> None:
        """Copies this rank's slice of checkpoint tensor ``name`` (a parameter of the
        layer, named as in the checkpoint) into the layer. Raises ValueError for an unknown
        name, a wrong full shape or a shard the packing cannot split."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Returns ``x W^T`` (no bias) for x [..., in_size], in x's dtype."""


class QuantizationConfig(ABC):
    """A checkpoint's (or --quantization's) quantization scheme."""

    # The --quantization value and quant_method this config answers to.
    name: str = ""

    @abstractmethod
    def linear_method(self, names: list[str], keys: frozenset[str]) -> LinearMethod | None:
        """The method of the linear layer whose checkpoint names (one per fused part, e.g.
        q/k/v) are ``names``; None keeps it in full precision. ``keys`` are the names of
        every checkpoint tensor. Raises ValueError when the parts of one fused layer are
        quantized differently."""

    def expert_scheme(self, prefix: str, keys: frozenset[str]) -> tuple[bool, bool]:
        """(FP8, per-tensor scales) for the mixture-of-experts experts whose checkpoint
        module is ``prefix``; by default they stay in full precision. Raises ValueError when
        the checkpoint has quantized expert tensors this format cannot run."""
        marker = prefix + "."
        for key in keys:
            if key.startswith(marker) and not key.endswith(".weight"):
                raise ValueError(
                    f"checkpoint tensor {key!r}: quantized mixture-of-experts experts are not "
                    f"supported for {self.name}; only attention and dense MLP layers may be "
                    "quantized"
                )
        return False, False
