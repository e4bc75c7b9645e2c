"""Column-major dense weights: the layout the CPU products are planned for.

The runner stores every full-precision dense weight and vocabulary table column-major
(``W.T`` contiguous, so ``x @ W.T`` is a plain "NN" product whose weight rows the native
few-row kernel streams; layers/batch_invariant_linear.py). It is also the faster layout for MKL at one
row and at large batches. Where a model has other matrices (quantized layers, fused experts),
the runner keeps padding every step to the larger row count (docs/architecture.md §6). A
submodule whose class sets ``multiplies_step_rows = False`` (a vision tower: it multiplies one
image's patches, never the step's token rows) is left out of that count.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.huge_pages import WeightArena
from vllm.model_executor.layers.linear import _QuantizableLinear
from vllm.model_executor.layers.vocab_embedding import VocabShard


def column_major(matrix: torch.Tensor, arena: WeightArena | None = None) -> torch.Tensor:
    """`matrix` (2-D) with the same shape and values, stored column-major: a copy (a float32
    CPU one in `arena`'s huge pages when given), unless it already is."""
    if matrix.t().is_contiguous():
        return matrix
    if arena is not None and matrix.dtype == torch.float32 and matrix.device.type == "cpu":
        stored = arena.empty(matrix.shape[1], matrix.shape[0])
        stored.copy_(matrix.t())
        return stored.t()
    return matrix.t().contiguous().t()


def make_column_major(model: nn.Module) -> bool:
    """Stores the weight of every full-precision dense layer and vocabulary table of
    ``model`` column-major (same shape and values, transposed strides), and says whether
    that covers every matrix the model multiplies by: True when no other parameter of two
    or more dimensions is left (quantized layers, fused experts), so that the row plans of
    these layers decide the padding alone. Parameters of submodules that set
    ``multiplies_step_rows = False`` never see a step's rows and do not count.

    Side effect: replaces those modules' ``weight`` parameters; a weight shared by two
    modules (tied embeddings) stays shared. Float32 copies go to transparent huge pages where
    Linux offers them (layers/huge_pages.py): every step streams them at small batches.
    """
    relaid: dict[int, nn.Parameter] = {}
    arena = WeightArena.create()
    for module in model.modules():
        if not _is_dense(module):
            continue
        weight = module.weight
        if id(weight) not in relaid:
            relaid[id(weight)] = nn.Parameter(column_major(weight.data, arena),
                                              requires_grad=False)
        module.weight = relaid[id(weight)]
    covered = {id(p) for p in relaid.values()}
    for module in model.modules():
        if not getattr(module, "multiplies_step_rows", True):
            covered.update(id(p) for p in module.parameters())
    return all(p.dim() < 2 or id(p) in covered for p in model.parameters())


def _is_dense(module: nn.Module) -> bool:
    if isinstance(module, _QuantizableLinear) and module.quant_method is not None:
        return False
    if not isinstance(module, (_QuantizableLinear, VocabShard)):
        return False
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.dtype.is_floating_point and weight.device.type == "cpu"
            and not weight.is_meta)
