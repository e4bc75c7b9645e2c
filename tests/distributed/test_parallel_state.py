"""Tests the parallel layout arithmetic of vllm/distributed/parallel_state.py."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.parallel_state import (
    ParallelContext,
    ParallelLayout,
    shard_range,
    stage_layers,
)


@pytest.mark.parametrize("num_layers", [1, 2, 3, 7, 28])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_layers_partition_contiguously(num_layers: int, pp: int) -> None:
    if pp > num_layers:
        with pytest.raises(ValueError, match="pipeline-parallel-size"):
            stage_layers(num_layers, pp, 0)
        return
    stages = [stage_layers(num_layers, pp, r) for r in range(pp)]
    # Contiguous and covering: each stage starts where the previous one ended.
    assert stages[0].start == 0 and stages[-1].stop == num_layers
    assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))
    sizes = [len(s) for s in stages]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    # Earlier stages take the extra layers (the last one also runs the LM head).
    assert sizes == sorted(sizes, reverse=True)


def test_stage_layers_examples() -> None:
    assert [stage_layers(7, 3, r) for r in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    assert ParallelLayout(tp_size=2, pp_size=2, rank=3).stage_layers(5) == range(3, 5)
    with pytest.raises(ValueError):
        ParallelLayout(pp_size=3, rank=0).stage_layers(2)


def test_shard_range() -> None:
    assert [shard_range(12, 3, i) for i in range(3)] == [(0, 4), (4, 4), (8, 4)]
    assert shard_range(5, 1, 0) == (0, 5)
    with pytest.raises(ValueError, match="10"):
        shard_range(10, 4, 0)


def test_layout_properties() -> None:
    # Rank r: tp_rank = r % tp, pp_rank = r // tp.
    got = [
        (lay.tp_rank, lay.pp_rank, lay.is_first_stage, lay.is_last_stage)
        for lay in (ParallelLayout(tp_size=2, pp_size=3, rank=r) for r in range(6))
    ]
    assert got == [
        (0, 0, True, False),
        (1, 0, True, False),
        (0, 1, False, False),
        (1, 1, False, False),
        (0, 2, False, True),
        (1, 2, False, True),
    ]
    layout = ParallelLayout(tp_size=2, pp_size=3, rank=0)
    assert layout.world_size == 6
    assert layout.rank_of(2, 1) == 5
    assert layout.output_rank == 4  # first rank of the last stage
    single = ParallelLayout()
    assert (single.world_size, single.output_rank) == (1, 0)
    assert single.is_first_stage and single.is_last_stage
    assert ParallelLayout(tp_size=4, pp_size=1, rank=3).output_rank == 0


@pytest.mark.parametrize(
    "kwargs", [dict(tp_size=0), dict(pp_size=0), dict(rank=1), dict(tp_size=2, rank=-1)]
)
def test_layout_rejects_bad_shapes(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ParallelLayout(**kwargs)


def test_single_context_collectives_are_identity() -> None:
    ctx = ParallelContext.single()
    x = torch.arange(6.0).reshape(2, 3)
    assert ctx.all_reduce(x) is x
    assert ctx.all_gather(x) is x
    assert ctx.broadcast(x) is x
    assert (ctx.tp_size, ctx.tp_rank) == (1, 0)
