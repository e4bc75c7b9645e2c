"""Building one quantized layer per tensor-parallel rank and running it (no processes)."""

from __future__ import annotations

import torch

from vllm.distributed.parallel_state import ParallelContext, ParallelLayout
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    deferred_weights,
)
from vllm.model_executor.layers.quantization.base import LinearMethod
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor


def ctx(tp: int, rank: int) -> ParallelContext:
    """Rank ``rank`` of a ``tp``-rank layout."""
    return ParallelContext(ParallelLayout(tp_size=tp, rank=rank))


def column_output(method: LinearMethod, parts: list[dict[str, torch.Tensor]], in_size: int,
                  x: torch.Tensor, tp: int) -> torch.Tensor:
    """The full output of a merged column-parallel layer over ``parts`` (checkpoint tensors
    by name), gathered from every rank in part order."""
    outs = []
    sizes = [p["out_size"] for p in parts]
    for rank in range(tp):
        with deferred_weights():
            layer = MergedColumnParallelLinear(in_size, sizes, parallel=ctx(tp, rank))
        layer.materialize(method)
        for i, tensors in enumerate(parts):
            for name, value in tensors.items():
                if name != "out_size":
                    layer.load_weight(name, CheckpointTensor(value), i)
        outs.append(layer.split(layer(x)))
    return torch.cat([torch.cat([o[i] for o in outs], -1) for i in range(len(parts))], -1)


def row_output(method: LinearMethod, tensors: dict[str, torch.Tensor], in_size: int,
               out_size: int, x: torch.Tensor, tp: int) -> torch.Tensor:
    """The output of a row-parallel layer: every rank's partial product, summed (the
    all-reduce)."""
    total = torch.zeros(x.shape[0], out_size)
    for rank in range(tp):
        with deferred_weights():
            layer = RowParallelLinear(in_size, out_size, parallel=ctx(tp, rank))
        layer.materialize(method)
        for name, value in tensors.items():
            layer.load_weight(name, CheckpointTensor(value))
        start, size = layer.input_start, layer.local_input_size
        total += method.apply(layer, x[:, start:start + size])
    return total
