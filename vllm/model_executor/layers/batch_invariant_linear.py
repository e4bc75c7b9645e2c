"""Batch-independent rows for the CPU's dense products, at the cost of the rows asked.

A CPU BLAS takes some kernels for a few rows and another for many, and they round a row
differently; where the switches lie depends on the CPU and the matrix (MKL on AVX-512: 1-3,
5-7 and 9-11 rows differ from 4, 8 and 12 or more). Async = sync equivalence needs each
request's numbers to be the same in any batch, so a product must either be padded into the
many-row kernel (a batch of one paying twelve rows of the LM head), or compute few rows in
exactly the many-row kernel's order. `plan` finds out once per weight which of the two works
here: it probes the BLAS with seeded random rows and looks for the chunk of the inner
dimension (the BLAS's k blocking) for which the native kernel (`_custom_ops.dense_rows`)
gives the many-row kernel's numbers bit for bit; `multiply` then sends products of up to
`NATIVE_MAX_ROWS` rows there, which read the weight once, and up to `NATIVE_WIDE_ROWS` on a
CPU whose widest vectors are the native kernel's own (docs/architecture.md §6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm import _custom_ops

# Up to this many rows the product is bound by streaming the weight, which the native kernel
# does once per call; from about twice as many it is bound by arithmetic, where the BLAS's
# register-blocked kernel is faster. Both give the same numbers, so this only moves time.
NATIVE_MAX_ROWS = 16
# Where the BLAS's vectors are no wider than the native kernel's (AVX2 against AVX2) the
# native kernel stays ahead further: on an AVX2 EPYC it beat MKL at 32 rows on every product
# of SmolLM2 (1.1-1.2x on the layers, 1.6x on the LM head; even at 64 rows on the heads, not
# on the layers). With AVX-512 the BLAS's kernels are twice as wide, so NATIVE_MAX_ROWS stays
# the bound there, and on CPUs without AVX2, where the native kernel is plain code.
NATIVE_WIDE_ROWS = 32
# Rows of the probe's reference product: more than the native kernel ever takes, so the
# reference is the kernel the BLAS uses for the rows the native kernel leaves to it.
_REFERENCE_ROWS = NATIVE_WIDE_ROWS + 1
# Inner-dimension blockings BLAS kernels use, tried after "no blocking" (the whole k).
_CHUNKS = (512, 384, 256, 192, 128, 96, 64, 48, 32, 16)


@dataclass(frozen=True)
class RowPlan:
    """How products with one weight keep each row independent of how many rows share them."""

    # The native kernel's k chunk that reproduces the BLAS's many-row numbers; None when
    # none does (or the native library is missing), and the BLAS does every product.
    chunk: int | None
    # Pad a product to at least this many rows (1 with a chunk: nothing to pad).
    min_rows: int
    # With a chunk: products of up to this many rows go to the native kernel.
    native_rows: int = NATIVE_MAX_ROWS


def plan(weight_t: torch.Tensor) -> RowPlan:
    """The plan for x @ weight_t (float32 CPU [K, N], rows contiguous), found by probing the
    BLAS and the native kernel with seeded random rows. Costs a few products with the
    weight (about 0.1 s for a 151,936 x 256 head on 2 cores, 0.3 s at 1,024 inputs; ten
    times that without the native kernel); changes nothing."""
    k = weight_t.shape[0]
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(_REFERENCE_ROWS, k, generator=gen)
    reference = torch.mm(probe, weight_t)
    # The native kernel may stand in for the BLAS's few-row kernels only if the BLAS gives
    # the reference's numbers from the first row count it keeps.
    first_blas = NATIVE_MAX_ROWS + 1
    blas_agrees = torch.equal(torch.mm(probe[:first_blas], weight_t), reference[:first_blas])
    if _custom_ops.HAS_NATIVE and weight_t.stride(1) == 1 and blas_agrees:
        few = probe[:2]
        out = torch.empty(2, weight_t.shape[1])
        for chunk in (k, *(c for c in _CHUNKS if c < k)):
            _custom_ops.dense_rows(few, weight_t, chunk, out)
            if torch.equal(out, reference[:2]):
                return RowPlan(chunk=chunk, min_rows=1, native_rows=native_rows_here())
    # The BLAS alone: the fewest rows from which each count up to the reference's rounds
    # its rows as the reference does.
    min_rows = _REFERENCE_ROWS
    while min_rows > 1:
        rows = min_rows - 1
        if not torch.equal(torch.mm(probe[:rows], weight_t), reference[:rows]):
            break
        min_rows = rows
    return RowPlan(chunk=None, min_rows=min_rows)


def native_rows_here() -> int:
    """The most rows a planned product sends to the native kernel on this CPU: NATIVE_WIDE_ROWS
    where torch's widest CPU kernels are AVX2 (the native kernel's own width), else
    NATIVE_MAX_ROWS. Either bound gives the same numbers; it moves time only."""
    wide = torch.backends.cpu.get_cpu_capability() == "AVX2"
    return NATIVE_WIDE_ROWS if wide else NATIVE_MAX_ROWS


def plan_model(model: nn.Module) -> int:
    """Plans every product of `model` that can take a plan (a module with a ``row_plan``
    attribute, such as Linear or ParallelLMHead, whose weight is an unquantized float32
    column-major CPU matrix) and returns the most rows any of them must be padded to (1 when
    none must). Weights of one shape share a probe.

    Side effect: sets those modules' ``row_plan``.
    """
    by_shape: dict[tuple[int, int], RowPlan] = {}
    most = 1
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "row_plan") or not _plannable(module, weight):
            continue
        shape = tuple(weight.shape)
        if shape not in by_shape:
            by_shape[shape] = plan(weight.t())
        module.row_plan = by_shape[shape]
        most = max(most, module.row_plan.min_rows)
    return most


def _plannable(module: nn.Module, weight: object) -> bool:
    return (isinstance(weight, torch.Tensor) and getattr(module, "quant_method", None) is None
            and weight.dim() == 2 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and not weight.is_meta
            and weight.stride(0) == 1 and weight.stride(1) >= weight.shape[0]
            and weight.numel() > 0)


def multiply(x: torch.Tensor, weight_t: torch.Tensor, row_plan: RowPlan,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight_t for a float32 CPU x [M, K], written into `out` when given (a contiguous
    float32 [M, N]) and returned; with the plan's chunk, up to row_plan.native_rows rows go
    to the native kernel, whose rows equal the BLAS's many-row rows. Does not pad: callers
    pad to row_plan.min_rows."""
    rows = x.shape[0]
    if row_plan.chunk is not None and 0 < rows <= row_plan.native_rows:
        if out is None:
            out = torch.empty(rows, weight_t.shape[1], dtype=torch.float32)
        # The worker thread's OpenMP default is not torch's setting: pass torch's.
        return _custom_ops.dense_rows(x.contiguous(), weight_t, row_plan.chunk, out,
                                      torch.get_num_threads())
    return torch.mm(x, weight_t, out=out) if out is not None else torch.mm(x, weight_t)
