"""The packed-tensor reader: unpacking 4-bit words and reading a rank's aligned slice."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.quantization.base import Shard
from vllm.model_executor.layers.quantization.packing import Axis, read_shard, unpack_int4
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor


def test_unpack_int4_reads_values_from_the_low_bits() -> None:
    values = torch.randint(0, 16, (3, 16), generator=torch.Generator().manual_seed(0))
    words = torch.zeros(3, 2, dtype=torch.int64)
    for j in range(8):
        words |= values[:, j::8] << (4 * j)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(unpack_int4(packed, 1), values.int())
    assert torch.equal(unpack_int4(packed.t().contiguous(), 0), values.int().t())


def test_read_shard_takes_a_ranks_packed_columns() -> None:
    full = torch.arange(4 * 6, dtype=torch.int32).reshape(4, 6)  # [out 4, in 48 / 8]
    layout = (Axis("out"), Axis("in", 8, "8 int4 values per int32"))
    param = torch.zeros(4, 3, dtype=torch.int32)
    read_shard(param, CheckpointTensor(full), layout, Shard(4, 0, 4, 0, 48, 24, 24), "w")
    assert torch.equal(param, full[:, 3:])


def test_read_shard_places_a_fused_part_by_rows() -> None:
    full = torch.arange(16 * 2, dtype=torch.int32).reshape(2, 16)  # [groups, out 128 / 8]
    layout = (Axis("in", 32, "group_size 32"), Axis("out", 8, "8 per int32"))
    param = torch.zeros(2, 12, dtype=torch.int32)  # two parts of 64 local rows
    read_shard(param, CheckpointTensor(full), layout, Shard(128, 64, 64, 32, 64, 0, 64), "z")
    assert torch.equal(param[:, 4:12], full[:, 8:16])
    assert not param[:, :4].any()


def test_read_shard_refuses_unaligned_slices_and_wrong_shapes() -> None:
    layout = (Axis("out"), Axis("in", 8, "8 int4 values per int32"))
    param = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"w: the tensor-parallel slice 20:40 is not aligned "
                                         r"to the 8 int4 values per int32 \(8\)"):
        read_shard(param, CheckpointTensor(torch.zeros(4, 5, dtype=torch.int32)), layout,
                   Shard(4, 0, 4, 0, 40, 20, 20), "w")
    with pytest.raises(ValueError, match=r"shape \(4, 4\) does not match expected \(4, 5\) "
                                         r"\(a hint\)"):
        read_shard(param, CheckpointTensor(torch.zeros(4, 4, dtype=torch.int32)), layout,
                   Shard(4, 0, 4, 0, 40, 0, 40), "w", "a hint")
