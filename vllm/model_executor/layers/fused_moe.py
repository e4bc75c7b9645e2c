"""Mixture-of-experts feed-forward layer (torch path): routing, grouped expert matmuls and
the weighted combine, with every expert's intermediate dimension split among the
tensor-parallel ranks.

Routing picks the ``top_k`` experts of each token from a softmax over the router logits.
The token-expert pairs are then sorted by expert once per layer, so each expert runs one
matmul over a contiguous run of the sorted pairs; the weighted results go back to their
tokens with one index_add. VLLM_MOE_BACKEND=triton swaps the expert loop for a Triton
grouped GEMM (fused_moe_triton.py; opt-in until it has been checked on a GPU).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.parallel_state import ParallelContext, shard_range
from vllm.model_executor.layers.linear import weights_deferred
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor, check_shape

# Per-expert checkpoint projections in the order gate, up, down.
ExpertNames = tuple[str, str, str]
QWEN_EXPERT_NAMES: ExpertNames = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES: ExpertNames = ("w1", "w3", "w2")
MOE_BACKENDS = ("torch", "triton")


def moe_backend() -> str:
    """The expert-matmul implementation VLLM_MOE_BACKEND names: 'torch' (default) or
    'triton'. Raises ValueError naming the variable for any other value."""
    backend = os.environ.get("VLLM_MOE_BACKEND", "torch").strip().lower() or "torch"
    if backend not in MOE_BACKENDS:
        raise ValueError(f"VLLM_MOE_BACKEND: {backend!r} is not one of {', '.join(MOE_BACKENDS)}")
    return backend


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights [T, top_k] float32, expert ids [T, top_k] int64) of each token.

    The weights are the softmax probabilities of the chosen experts, divided by their sum
    when ``renormalize`` is set. The softmax runs in float32 whatever the logits' dtype, so
    low-precision models route like their reference implementations.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Maps tokens [T, H] to sum_k weight[t, k] * expert_{id[t, k]}(hidden[t]), [T, H].

    Expert e computes w2[e] @ (silu(gate) * up) with [gate; up] = w13[e] @ x, where w13 is
    [E, 2 * I, H] (gate rows then up rows) and w2 is [E, H, I]. Under tensor parallelism I
    is this rank's slice and the result is this rank's partial sum (not yet all-reduced).
    FP8 weights come with float32 row scales ``w13_scale`` [E, 2 * I] and ``w2_scale``
    [E, H]; only the experts that have tokens are dequantized, one at a time.
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)
    if num_tokens == 0:
        return out
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        # The per-expert token counts below are read on the host, which a graph cannot hold.
        raise RuntimeError("the torch MoE path cannot be captured in a CUDA graph")
    flat_ids = topk_ids.reshape(-1)
    # One stable sort groups the token-expert pairs by expert; pair p belongs to token
    # p // top_k, since flat_ids lists each token's top_k choices together.
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # one host sync
    x = hidden.index_select(0, token_of)
    y = torch.empty_like(x)
    intermediate = w2.shape[2]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate_up = F.linear(x[rows], _expert_weight(w13, w13_scale, expert, x.dtype))
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y[rows] = F.linear(act, _expert_weight(w2, w2_scale, expert, x.dtype))
        start += count
    y.mul_(topk_weights.reshape(-1)[order].to(y.dtype).unsqueeze(1))
    return out.index_add_(0, token_of, y)


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, expert: int,
                   dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w[expert]
    return w[expert].to(dtype) * scale[expert].to(dtype).unsqueeze(1)


# Checkpoint suffix of each stacked parameter's per-expert tensors.
_SUFFIX = {"w13_weight": "weight", "w2_weight": "weight",
           "w13_weight_scale": "weight_scale", "w2_weight_scale": "weight_scale"}


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer, their weights stacked: ``w13_weight``
    [E, 2 * I_local, H] and ``w2_weight`` [E, H, I_local].

    Each expert's intermediate dimension I is split evenly among the tensor-parallel ranks
    (w13 by rows, like a column-parallel layer; w2 by columns, like a row-parallel one);
    forward all-reduces the partial outputs, so every rank returns the full result.
    Checkpoints hold one tensor per expert and projection, ``{e}.{name}.weight`` under this
    module, with the names given by ``expert_names`` (gate, up, down).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        parallel: ParallelContext | None = None,
        expert_names: ExpertNames = QWEN_EXPERT_NAMES,
    ) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts: {num_experts} must be positive")
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok: {top_k} must be between 1 and num_experts ({num_experts})"
            )
        self.parallel = parallel or ParallelContext.single()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.expert_names = expert_names
        self.backend = moe_backend()
        self.shard_start, local = shard_range(
            intermediate_size, self.parallel.tp_size, self.parallel.tp_rank
        )
        self.local_intermediate = local
        # FP8 experts (a compressed-tensors checkpoint): per-row scales, per tensor or not.
        self.fp8 = False
        self.per_tensor_scales = False
        # Uninitialized: the loader overwrites every parameter. Built under quantization's
        # deferred_weights(), only the shapes exist until materialize().
        device = "meta" if weights_deferred() else None
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size, device=device), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, local, device=device), requires_grad=False
        )

    def materialize(self, fp8: bool, per_tensor_scales: bool = False) -> None:
        """Gives experts built under deferred_weights() their parameters on the current
        default device and dtype: dense, or FP8 weights with float32 row scales
        ``w13_weight_scale`` [E, 2 * I_local] and ``w2_weight_scale`` [E, H] (the
        checkpoint's scales per output channel, or one per tensor when
        ``per_tensor_scales``). Raises ValueError with fp8 on the Triton backend."""
        if not self.w13_weight.is_meta:
            raise RuntimeError("materialize: these experts were not built under "
                               "deferred_weights()")
        if fp8 and self.backend == "triton":
            raise ValueError("VLLM_MOE_BACKEND=triton does not run FP8 experts; use torch")
        dtype = torch.float8_e4m3fn if fp8 else None
        shapes = {"w13_weight": self.w13_weight.shape, "w2_weight": self.w2_weight.shape}
        for name, shape in shapes.items():
            delattr(self, name)
            self.register_parameter(
                name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
        self.fp8, self.per_tensor_scales = fp8, per_tensor_scales
        if fp8:
            e, local, hidden = self.num_experts, self.local_intermediate, self.hidden_size
            self.w13_weight_scale = nn.Parameter(
                torch.empty(e, 2 * local, dtype=torch.float32), requires_grad=False)
            self.w2_weight_scale = nn.Parameter(
                torch.empty(e, hidden, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Maps tokens [T, H] and router logits [T, E] to the experts' combined output [T, H].

        Side effect (tp > 1): an all-reduce over the tensor-parallel group.
        """
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        experts = fused_experts
        if self.backend == "triton":
            # Imported only when chosen: triton is optional on a CPU-only install.
            from vllm.model_executor.layers.fused_moe_triton import triton_fused_experts

            experts = triton_fused_experts
        if self.fp8:
            out = fused_experts(hidden, self.w13_weight, self.w2_weight, weights, ids,
                                self.w13_weight_scale, self.w2_weight_scale)
        else:
            out = experts(hidden, self.w13_weight, self.w2_weight, weights, ids)
        return self.parallel.all_reduce(out)

    def checkpoint_parts(self, param_name: str) -> list[tuple[str, int]]:
        """(checkpoint name under this module, part) of every tensor that fills a parameter.

        Part 2e / 2e + 1 of ``w13_weight`` is expert e's gate / up projection; part e of
        ``w2_weight`` is expert e's down projection.
        """
        gate, up, down = self.expert_names
        suffix = _SUFFIX.get(param_name)
        if param_name.startswith("w13_") and suffix:
            return [
                (f"{e}.{name}.{suffix}", 2 * e + i)
                for e in range(self.num_experts)
                for i, name in enumerate((gate, up))
            ]
        if param_name.startswith("w2_") and suffix:
            return [(f"{e}.{down}.{suffix}", e) for e in range(self.num_experts)]
        raise ValueError(f"this layer has no {param_name!r} parameter")

    def load_weight(
        self, param_name: str, tensor: CheckpointTensor, part: int | None = None
    ) -> None:
        """Copies this rank's slice of one expert's full checkpoint projection into the
        stacked parameter (see checkpoint_parts for what ``part`` means).

        Raises ValueError for a missing or out-of-range part, an unknown parameter or a
        checkpoint tensor whose full shape is wrong.
        """
        local, start = self.local_intermediate, self.shard_start
        if param_name in ("w13_weight", "w2_weight") and self.fp8:
            # Reading would cast anything to FP8; only FP8 codes match the scales.
            dtype = tensor.read_range(0, 0, 0).dtype
            if dtype != torch.float8_e4m3fn:
                raise ValueError(f"dtype {dtype} is not the FP8 (float8_e4m3fn) of the "
                                 "quantization_config")
        if param_name.endswith("_scale"):
            self._load_scale(param_name, tensor, part)
        elif param_name == "w13_weight":
            if part is None or not 0 <= part < 2 * self.num_experts:
                raise ValueError(f"w13_weight has no part {part}")
            expert, half = divmod(part, 2)
            check_shape(tensor, (self.intermediate_size, self.hidden_size))
            with torch.no_grad():
                target = self.w13_weight.data[expert].narrow(0, half * local, local)
                target.copy_(tensor.read_range(0, start, local))
        elif param_name == "w2_weight":
            if part is None or not 0 <= part < self.num_experts:
                raise ValueError(f"w2_weight has no part {part}")
            check_shape(tensor, (self.hidden_size, self.intermediate_size))
            with torch.no_grad():
                self.w2_weight.data[part].copy_(tensor.read_range(1, start, local))
        else:
            raise ValueError(f"this layer has no {param_name!r} parameter")

    def _load_scale(self, param_name: str, tensor: CheckpointTensor, part: int | None) -> None:
        """Copies one expert projection's scales (per output row [rows, 1], or one value
        per tensor) into its rows of a stacked scale parameter."""
        local, start = self.local_intermediate, self.shard_start
        param = getattr(self, param_name, None)
        count = 2 * self.num_experts if param_name == "w13_weight_scale" else self.num_experts
        if param is None or part is None or not 0 <= part < count:
            raise ValueError(f"this layer has no {param_name!r} part {part}")
        if param_name == "w13_weight_scale":
            expert, half = divmod(part, 2)
            rows, full = (half * local, local), self.intermediate_size
        else:
            expert, rows, full = part, (0, self.hidden_size), self.hidden_size
        target = param.data[expert].narrow(0, *rows)
        with torch.no_grad():
            if self.per_tensor_scales:
                if tensor.shape not in ((), (1,)):
                    raise ValueError(f"shape {tuple(tensor.shape)} does not match expected "
                                     "(1,) (strategy 'tensor' in quantization_config)")
                target.fill_(float(tensor.read().reshape(-1)[0]))
                return
            check_shape(tensor, (full, 1))
            first = start if param_name == "w13_weight_scale" else 0
            target.copy_(tensor.read_range(0, first, rows[1]).reshape(-1))

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size} (from {self.shard_start}: "
            f"{self.local_intermediate}), renormalize={self.renormalize}, "
            f"backend={self.backend}"
        )
