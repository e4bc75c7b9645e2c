"""A linear layer with stacked LoRA slots, applied to many adapters in one batched pass.

Each wrapped layer holds, per slot s, ``A[s]`` [parts * max_rank, in] and ``B[s]``
[out, parts * max_rank]. A fused layer (q/k/v, gate/up) has one rank block per part: part
p's A fills rows ``p*R:p*R+r`` of ``A[s]`` and its B the columns ``p*R:p*R+r`` of ``B[s]``,
restricted to the part's rows of the fused output, so ``(x A[s]^T) B[s]^T`` gives every
part its own delta in one pair of matmuls. Unused rows and columns stay zero.

Under tensor parallelism a layer keeps the shard of the adapter that matches its own: a
column-parallel layer the rows of B of its output slice (A whole), a row-parallel layer the
columns of A of its input slice (B whole), whose partial ``x A^T`` is summed over the
group before B, as the base layer sums its partial outputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from vllm.lora.triton_ops import SlotPlan


LORA_BACKENDS = ("torch", "triton")


def lora_backend() -> str:
    """The LoRA kernel VLLM_LORA_BACKEND names: 'torch' (default: a matmul pair per active
    slot) or 'triton' (two grouped launches for all slots). Raises ValueError naming the
    variable for any other value."""
    backend = os.environ.get("VLLM_LORA_BACKEND", "torch").strip().lower() or "torch"
    if backend not in LORA_BACKENDS:
        raise ValueError(
            f"VLLM_LORA_BACKEND: {backend!r} is not one of {', '.join(LORA_BACKENDS)}")
    return backend


class LoRABatch:
    """The token rows of one forward pass grouped by slot; shared by every LoRA layer of a
    model and set once per forward by the runner (no layer regroups)."""

    def __init__(
        self,
        to_device: Callable[[np.ndarray], torch.Tensor],
        min_rows: int,
        num_slots: int = 0,
        backend: str = "torch",
    ) -> None:
        """`to_device` copies a host array to the model's device without blocking the host
        (the runner's InputBuffers.to_device: a step must not wait for the one before).
        `backend` "triton" plans the rows of `num_slots` slots for triton_ops.apply_lora."""
        self.to_device = to_device
        self.num_slots = num_slots
        self.backend = backend
        # The triton backend's plan of this forward's rows; None without adapter rows.
        self.plan: SlotPlan | None = None
        if backend == "triton":
            # Imported only when chosen: triton is optional on a CPU-only install.
            from vllm.lora import triton_ops
            self.triton_ops = triton_ops
        # Gathered groups are padded to this many rows, so that a row's result does not
        # depend on how many rows share its adapter in this batch (CPU GEMMs on very few
        # rows round differently; see the runner's _CPU_MIN_ROWS).
        self.min_rows = min_rows
        # (slot, padded row indices on the device, number of real rows).
        self.groups: list[tuple[int, torch.Tensor, int]] = []

    def set_token_slots(self, token_slots: np.ndarray) -> None:
        """Groups the rows by slot: ``token_slots[i]`` is row i's slot, -1 for the base model
        (and for padding rows), which no LoRA layer touches."""
        slots = np.unique(token_slots[token_slots >= 0]).tolist()
        self.plan = None
        if not slots:
            self.groups = []
            return
        if self.backend == "triton":
            self.plan = self.triton_ops.SlotPlan(self.to_device(token_slots.astype(np.int64)), self.num_slots)
            self.groups = []
            return
        parts: list[np.ndarray] = []
        counts: list[int] = []
        for slot in slots:
            rows = np.nonzero(token_slots == slot)[0]
            padded = np.full(max(len(rows), self.min_rows), rows[0], dtype=np.int64)
            padded[: len(rows)] = rows
            parts.append(padded)
            counts.append(len(rows))
        # One host-to-device copy per forward; each group is a view of it.
        flat = self.to_device(np.concatenate(parts))
        groups: list[tuple[int, torch.Tensor, int]] = []
        start = 0
        for slot, padded, n in zip(slots, parts, counts):
            groups.append((int(slot), flat[start : start + len(padded)], n))
            start += len(padded)
        self.groups = groups

    def clear(self) -> None:
        """Back to base-model-only rows."""
        self.groups = []
        self.plan = None


class LoRALinear(nn.Module):
    """Wraps a (possibly fused) linear layer: its output plus each row's adapter delta.

    ``part_sizes`` are the output sizes of the parts in fused order (one for a plain
    layer); the wrapped layer's own forward is unchanged.
    """

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        part_sizes: list[int],
        batch: LoRABatch,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        out_shards: list[tuple[int, int]] | None = None,
        in_shard: tuple[int, int] | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """``out_shards[p]``: (start, length) of part p's full output rows this rank holds
        (column-parallel); ``in_shard``: (start, length) of the full input columns it holds
        and ``reduce`` the sum over its group (row-parallel). None: the whole layer."""
        super().__init__()
        self.base = base
        self.out_shards = out_shards
        self.in_shard = in_shard
        self.reduce = reduce
        self.batch = batch
        self.max_rank = max_rank
        self.part_sizes = list(part_sizes)
        self.part_offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        width = len(part_sizes) * max_rank
        out = sum(part_sizes)
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, out, width, dtype=dtype, device=device)
        )

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The wrapped fused layer's split of an output into its parts."""
        return self.base.split(y)

    def clear_slot(self, slot: int) -> None:
        """Zeroes a slot: rows in it get no delta from this layer."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Writes one part's full A [r, in] and scaled B [part_size, r] into a slot (this
        rank's shard of them)."""
        if self.in_shard is not None:
            a = a.narrow(1, *self.in_shard)
        if self.out_shards is not None:
            b = b.narrow(0, *self.out_shards[part])
        rank = a.shape[0]
        lo = part * self.max_rank
        off, size = self.part_offsets[part], self.part_sizes[part]
        self.lora_a[slot, lo : lo + rank].copy_(a)
        self.lora_b[slot, off : off + size, lo : lo + rank].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [T, in] to [T, out]: the base output, plus for the rows of each active slot
        ``(x A^T) B^T``. Rows of the base model are left exactly as the base computed them."""
        y = self.base(x)
        if self.batch.plan is not None:
            return self.batch.triton_ops.apply_lora(
                y, x, self.lora_a, self.lora_b, self.batch.plan, self.reduce)
        for slot, rows, n in self.batch.groups:
            xs = x.index_select(0, rows)
            shrunk = F.linear(xs, self.lora_a[slot])
            if self.reduce is not None:
                shrunk = self.reduce(shrunk)  # partial over this rank's input columns
            delta = F.linear(shrunk, self.lora_b[slot])
            y.index_add_(0, rows[:n], delta[:n])
        return y

    def extra_repr(self) -> str:
        return (
            f"slots={self.lora_a.shape[0]}, max_rank={self.max_rank}, "
            f"parts={self.part_sizes}"
        )
