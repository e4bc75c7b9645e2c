"""Dense linear layers, replicated or sharded across the tensor-parallel ranks.

Column-parallel layers keep a slice of the output rows (no communication); row-parallel
layers keep a slice of the input columns and sum their partial outputs over the group.
Every layer loads itself from full checkpoint tensors, reading only its own slice.

With quantization, layers are built inside ``deferred_weights()``: each declares its weight
without memory until the loader calls ``materialize`` with the layer's quantization method
(or None for full precision); the method then owns the layer's packed parameters, their
loading and the matmul (layers/quantization, docs/architecture.md §7).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.parallel_state import ParallelContext, shard_range
from vllm.model_executor.layers import batch_invariant_linear
from vllm.model_executor.layers.quantization.base import LinearMethod, Shard
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor, check_shape

_DEFER = ContextVar("defer_linear_weights", default=False)


@contextmanager
def deferred_weights(enabled: bool = True) -> Iterator[None]:
    """Linear layers built inside this context (when ``enabled``) declare their weight on
    the meta device, to be given real parameters by ``materialize``."""
    token = _DEFER.set(enabled)
    try:
        yield
    finally:
        _DEFER.reset(token)


def weights_deferred() -> bool:
    """Whether layers built now declare their weights without memory (deferred_weights)."""
    return _DEFER.get()


def _parameter(module: nn.Module, param_name: str) -> nn.Parameter:
    param = getattr(module, param_name, None)
    if not isinstance(param, nn.Parameter):
        raise ValueError(f"this layer has no {param_name!r} parameter")
    return param


def _empty(*shape: int) -> nn.Parameter:
    # Uninitialized on purpose: the loader overwrites every parameter, and initializing
    # billions of weights only to discard them would slow startup.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _weight(out_size: int, in_size: int) -> nn.Parameter:
    if weights_deferred():
        # Shape only: materialize() replaces it once the quantization method is known.
        return nn.Parameter(torch.empty(out_size, in_size, device="meta"), requires_grad=False)
    return _empty(out_size, in_size)


class _QuantizableLinear(nn.Module):
    """What every linear layer shares: a weight that a quantization method may own."""

    input_size: int
    weight: nn.Parameter
    bias: nn.Parameter | None
    quant_method: LinearMethod | None = None
    # How the CPU product keeps each row independent of the batch (set by
    # batch_invariant_linear.plan_model); None: F.linear.
    row_plan: batch_invariant_linear.RowPlan | None = None
    _local_sizes: tuple[int, int]

    @property
    def local_input_size(self) -> int:
        """Input columns this rank multiplies (the whole input unless row-parallel)."""
        return self.local_sizes[1]

    def materialize(self, method: LinearMethod | None) -> None:
        """Gives a layer built under deferred_weights() its parameters, on the current
        default device and dtype: the dense ``weight`` (method None) or the method's
        packed ones. Raises ValueError when the method cannot pack this layer's size."""
        out_size, in_size = self.local_sizes
        if not self.weight.is_meta:
            raise RuntimeError("materialize: this layer was not built under deferred_weights()")
        del self.weight
        if method is None:
            self.weight = _empty(out_size, in_size)
            return
        method.create(self, out_size, in_size, self.input_size)
        self.quant_method = method

    @property
    def local_sizes(self) -> tuple[int, int]:
        """(output rows, input columns) of this rank's weight."""
        return self._local_sizes

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        plan = self.row_plan
        # The cheapest checks first (`dtype is`, is_cpu): every dense layer of every decode
        # step comes here, at one token in a few microseconds of Python.
        if (plan is not None and x.dtype is torch.float32 and x.is_cpu
                and self.quant_method is None):
            # The bias is added apart, so the product is the plan's whatever the row count.
            if x.dim() == 2:
                y = batch_invariant_linear.multiply(x, self.weight.t(), plan)
            else:
                flat = x.reshape(-1, x.shape[-1])
                y = batch_invariant_linear.multiply(flat, self.weight.t(), plan)
                y = y.reshape(*x.shape[:-1], y.shape[-1])
            return y if bias is None else y.add_(bias)
        if self.quant_method is None:
            return F.linear(x, self.weight, bias)
        y = self.quant_method.apply(self, x)
        return y if bias is None else y + bias

    def _load_quantized(self, param_name: str, tensor: CheckpointTensor, shard: Shard) -> bool:
        """Lets the quantization method load a tensor other than the bias; False when the
        layer is not quantized or it is the bias."""
        if self.quant_method is None or param_name == "bias":
            return False
        self.quant_method.load(self, param_name, tensor, shard)
        return True


class Linear(_QuantizableLinear):
    """A dense ``y = x W^T + b`` layer, the same on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self._local_sizes = (output_size, input_size)
        self.weight = _weight(output_size, input_size)
        self.bias = _empty(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the layer to the last dimension of x."""
        return self._matmul(x, self.bias)

    def load_weight(
        self, param_name: str, tensor: CheckpointTensor, part: int | None = None
    ) -> None:
        """Copies a whole checkpoint tensor into ``weight`` or ``bias`` (or, quantized,
        into the method's parameter of that name).

        Raises ValueError for a part index (this layer is not fused), an unknown parameter
        or a wrong shape.
        """
        if part is not None:
            raise ValueError(f"this layer has no part {part}")
        shard = Shard.whole(self.output_size, self.input_size)
        if self._load_quantized(param_name, tensor, shard):
            return
        param = _parameter(self, param_name)
        check_shape(tensor, tuple(param.shape))
        with torch.no_grad():
            param.data.copy_(tensor.read())

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedColumnParallelLinear(Linear):
    """Several linear layers over the same input, fused into one matrix, each sharded by rows.

    Part ``i`` has ``full_sizes[i]`` output rows in the checkpoint; this rank holds rows
    ``shards[i] = (start, length)`` of it, stored at rows ``offsets[i]:offsets[i] + length``
    of the fused weight. By default each part is split evenly among the ranks.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        parallel: ParallelContext | None = None,
        shards: list[tuple[int, int]] | None = None,
    ) -> None:
        ctx = parallel or ParallelContext.single()
        if shards is None:
            shards = [shard_range(size, ctx.tp_size, ctx.tp_rank) for size in output_sizes]
        if len(shards) != len(output_sizes):
            raise ValueError(f"{len(shards)} shards for {len(output_sizes)} parts")
        # Sizes of the parts on this rank: what forward's output splits into.
        local_sizes = [length for _, length in shards]
        # forward (Linear's) maps [..., input_size] to the fused [..., sum(output_sizes)].
        super().__init__(input_size, sum(local_sizes), bias)
        self.full_sizes = list(output_sizes)
        self.shards = list(shards)
        self.output_sizes = local_sizes
        self.offsets = [sum(local_sizes[:i]) for i in range(len(local_sizes))]

    def load_weight(
        self, param_name: str, tensor: CheckpointTensor, part: int | None = None
    ) -> None:
        """Copies this rank's rows of one full checkpoint part into ``weight`` or ``bias``.

        ``part`` may be omitted when the layer has a single part. Raises ValueError for a
        part that does not exist, an unknown parameter, or a checkpoint tensor whose full
        shape is wrong.
        """
        if part is None and len(self.shards) == 1:
            part = 0
        if part is None or not 0 <= part < len(self.shards):
            raise ValueError(f"part index {part} out of range for {len(self.shards)} parts")
        start, length = self.shards[part]
        shard = Shard(self.full_sizes[part], start, length, self.offsets[part],
                      self.input_size, 0, self.input_size)
        if self._load_quantized(param_name, tensor, shard):
            return
        param = _parameter(self, param_name)
        check_shape(tensor, (self.full_sizes[part],) + tuple(param.shape[1:]))
        with torch.no_grad():
            target = param.data.narrow(0, self.offsets[part], length)
            target.copy_(tensor.read_range(0, start, length))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Splits a fused output into this rank's outputs of the individual layers."""
        return tuple(y.split(self.output_sizes, dim=-1))

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.full_sizes}, shards={self.shards}, "
            f"bias={self.bias is not None}"
        )


class ColumnParallelLinear(MergedColumnParallelLinear):
    """A linear layer whose output rows are split evenly among the tensor-parallel ranks;
    each rank returns its slice of the output."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__(input_size, [output_size], bias, parallel)


def qkv_shards(
    num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, tp_rank: int
) -> list[tuple[int, int]]:
    """(start, length) of the q, k and v rows that tensor-parallel rank ``tp_rank`` holds.

    Query heads split evenly. KV heads split evenly while there are at least as many as
    ranks; otherwise each rank holds one whole KV head, head ``tp_rank * num_kv_heads //
    tp_size``, so every KV head is replicated on ``tp_size / num_kv_heads`` consecutive
    ranks (the ranks whose query heads use it). Raises ValueError when neither works.
    """
    q_start, q_heads = shard_range(num_heads, tp_size, tp_rank)
    if tp_size <= num_kv_heads:
        kv_start, kv_heads = shard_range(num_kv_heads, tp_size, tp_rank)
    else:
        if tp_size % num_kv_heads:
            raise ValueError(
                f"{num_kv_heads} KV heads can neither be split nor replicated evenly over "
                f"{tp_size} tensor-parallel ranks"
            )
        kv_start, kv_heads = tp_rank * num_kv_heads // tp_size, 1
    q = (q_start * head_dim, q_heads * head_dim)
    kv = (kv_start * head_dim, kv_heads * head_dim)
    return [q, kv, kv]


class QKVParallelLinear(MergedColumnParallelLinear):
    """The fused q/k/v projection, sharded by attention heads (see qkv_shards).

    ``num_heads`` and ``num_kv_heads`` are the heads on this rank.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        parallel: ParallelContext | None = None,
    ) -> None:
        ctx = parallel or ParallelContext.single()
        shards = qkv_shards(num_heads, num_kv_heads, head_dim, ctx.tp_size, ctx.tp_rank)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, ctx, shards)
        self.head_dim = head_dim
        self.num_heads = shards[0][1] // head_dim
        self.num_kv_heads = shards[1][1] // head_dim


class RowParallelLinear(_QuantizableLinear):
    """A linear layer whose input columns are split evenly among the tensor-parallel ranks.

    Takes this rank's slice of the input (the output of a column-parallel layer) and returns
    the full output, identical on every rank: the partial products are summed over the
    group, and the bias (replicated) is added once, after the sum.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        self.input_size = input_size
        self.output_size = output_size
        self.input_start, local = shard_range(
            input_size, self.parallel.tp_size, self.parallel.tp_rank
        )
        self._local_sizes = (output_size, local)
        self.weight = _weight(output_size, local)
        self.bias = _empty(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps this rank's input slice [..., input_size / tp] to the full [..., output_size].

        Side effect (tp > 1): an all-reduce over the tensor-parallel group.
        """
        if self.parallel.tp_size == 1:
            # Same kernel as an unsharded layer, so single-rank results are unchanged.
            return self._matmul(x, self.bias)
        y = self.parallel.all_reduce(self._matmul(x, None))
        return y if self.bias is None else y.add_(self.bias)

    def load_weight(
        self, param_name: str, tensor: CheckpointTensor, part: int | None = None
    ) -> None:
        """Copies this rank's columns of the full checkpoint weight, or the whole bias.

        Raises ValueError for a part index, an unknown parameter or a wrong full shape.
        """
        if part is not None:
            raise ValueError(f"this layer has no part {part}")
        local = self.local_sizes[1]
        shard = Shard(self.output_size, 0, self.output_size, 0,
                      self.input_size, self.input_start, local)
        if self._load_quantized(param_name, tensor, shard):
            return
        param = _parameter(self, param_name)
        with torch.no_grad():
            if param_name == "bias":
                check_shape(tensor, (self.output_size,))
                param.data.copy_(tensor.read())
                return
            check_shape(tensor, (self.output_size, self.input_size))
            param.data.copy_(tensor.read_range(1, self.input_start, param.shape[1]))

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size} (from {self.input_start}: {self.local_sizes[1]}), "
            f"out={self.output_size}, bias={self.bias is not None}"
        )
