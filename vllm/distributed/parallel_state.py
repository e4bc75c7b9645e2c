"""Where a rank sits in the tensor x pipeline layout, and the collectives the model uses.

Rank r of a world of tp * pp ranks has tp_rank = r % tp and pp_rank = r // tp
(docs/architecture.md §10). Nothing here is global: a worker builds one `ParallelContext`
and hands it to the model and the model runner; a single-rank engine uses
`ParallelContext.single()`, whose collectives do nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

# Stage-to-stage sends not yet known to be delivered; older ones are waited for first.
_MAX_PENDING_SENDS = 8
# Tags of stage-to-stage messages wrap around here (gloo and NCCL take int32 tags).
_MAX_TAG = 1 << 30


@dataclass(frozen=True)
class ParallelLayout:
    """The shape of the world and this rank's place in it."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"parallel layout: sizes must be positive, got {self}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"parallel layout: rank {self.rank} outside world {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        """The global rank at (pp_rank, tp_rank)."""
        return pp_rank * self.tp_size + tp_rank

    @property
    def output_rank(self) -> int:
        """The rank whose sampled tokens answer the engine: the first of the last stage."""
        return self.rank_of(self.pp_size - 1, 0)

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers this rank's stage owns: contiguous, as even as possible, with
        the extra layers on the earlier stages (the last one also runs the LM head)."""
        return stage_layers(num_layers, self.pp_size, self.pp_rank)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Layers of stage `pp_rank` out of `pp_size` (see ParallelLayout.stage_layers).

    Raises ValueError when a stage would get no layer.
    """
    if pp_size > num_layers:
        raise ValueError(
            f"--pipeline-parallel-size {pp_size}: more stages than the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def shard_range(size: int, num_shards: int, index: int) -> tuple[int, int]:
    """(start, length) of shard `index` when `size` splits into `num_shards` equal parts.

    Raises ValueError when it does not split evenly.
    """
    if size % num_shards:
        raise ValueError(f"a dimension of {size} does not split into {num_shards} equal shards")
    length = size // num_shards
    return index * length, length


@dataclass
class ParallelContext:
    """This rank's layout plus the process groups its collectives run on.

    Every collective is a no-op (returns its input) when its group has one rank, so model
    code calls them unconditionally.
    """

    layout: ParallelLayout = field(default_factory=ParallelLayout)
    # The ranks of this rank's stage (None when tp_size is 1).
    tp_group: Any = None
    _sends: deque[tuple[Any, torch.Tensor]] = field(default_factory=deque, repr=False)
    # Messages sent to the next stage and received from the previous one so far.
    _tags: dict[str, int] = field(default_factory=dict, repr=False)

    @classmethod
    def single(cls) -> ParallelContext:
        """The context of a one-rank engine."""
        return cls()

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the tensor-parallel group. Side effect: x holds the sum (in place)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every tensor-parallel rank's x along the last dimension, in rank order."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Copies tensor-parallel rank 0's x to every rank of the group (in place)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        src = self.layout.rank_of(self.layout.pp_rank, 0)
        dist.broadcast(x, src=src, group=self.tp_group)
        return x

    def send_next(self, tensor: torch.Tensor) -> None:
        """Starts sending `tensor` to the same tensor-parallel rank of the next stage and
        returns without waiting (the tensor is kept alive until delivered).

        Every message carries its own tag (a counter both stages advance in step): gloo
        does not promise to match several outstanding sends of one tag in order.
        """
        import torch.distributed as dist

        layout = self.layout
        dst = layout.rank_of(layout.pp_rank + 1, layout.tp_rank)
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst, tag=self._next_tag("send"))
        self._sends.append((work, tensor))
        while len(self._sends) > _MAX_PENDING_SENDS:
            self._wait_oldest_send()

    def recv_prev(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Receives the next tensor (of `shape`) that the same tensor-parallel rank of the
        previous stage sent, in send order. Blocks until it arrives."""
        import torch.distributed as dist

        layout = self.layout
        src = layout.rank_of(layout.pp_rank - 1, layout.tp_rank)
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src, tag=self._next_tag("recv"))
        return out

    def _next_tag(self, direction: str) -> int:
        count = self._tags.get(direction, 0)
        self._tags[direction] = count + 1
        return count % _MAX_TAG

    def _wait_oldest_send(self) -> None:
        work, _ = self._sends.popleft()
        work.wait()


def init_distributed(
    layout: ParallelLayout, init_method: str, device: torch.device
) -> ParallelContext:
    """Joins this process to the world (gloo on CPU, NCCL on CUDA) and creates the
    tensor-parallel groups. Every rank must call it with the same sizes and init_method.

    Side effect: initializes torch.distributed's default process group for this process.
    """
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, world_size=layout.world_size, rank=layout.rank
    )
    tp_group = None
    for pp_rank in range(layout.pp_size):
        ranks = [layout.rank_of(pp_rank, t) for t in range(layout.tp_size)]
        # Every rank creates every group (torch.distributed requires it), keeping its own.
        group = dist.new_group(ranks) if layout.tp_size > 1 else None
        if pp_rank == layout.pp_rank:
            tp_group = group
    return ParallelContext(layout, tp_group)


def destroy_distributed(context: ParallelContext) -> None:
    """Leaves the world, dropping sends still pending (the engine is stopping: nobody waits
    for them, and the next stage may be gone already). Idempotent."""
    import torch.distributed as dist

    context._sends.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
