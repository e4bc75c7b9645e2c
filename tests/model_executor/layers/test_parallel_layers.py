"""What each tensor-parallel rank of the sharded layers holds and loads (no processes: only
loading and local shapes need the layout, not the collectives)."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.parallel_state import ParallelContext, ParallelLayout
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    qkv_shards,
)
from vllm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor


def _ctx(tp: int, rank: int) -> ParallelContext:
    return ParallelContext(ParallelLayout(tp_size=tp, rank=rank))


def _full(*shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def test_qkv_shards_split_or_replicate_kv_heads() -> None:
    # 8 query heads, 4 KV heads, head_dim 2, over 2 ranks: everything splits.
    assert qkv_shards(8, 4, 2, 2, 1) == [(8, 8), (4, 4), (4, 4)]
    # 4 ranks over 2 KV heads: ranks 0, 1 hold head 0 and ranks 2, 3 hold head 1, matching
    # the query heads each rank holds (query head h uses KV head h // 4).
    kv = [qkv_shards(8, 2, 2, 4, r)[1] for r in range(4)]
    assert kv == [(0, 2), (0, 2), (2, 2), (2, 2)]
    assert [qkv_shards(8, 2, 2, 4, r)[0] for r in range(4)] == [(0, 4), (4, 4), (8, 4), (12, 4)]
    with pytest.raises(ValueError):
        qkv_shards(6, 2, 2, 3, 0)  # 3 ranks cannot replicate 2 KV heads evenly
    with pytest.raises(ValueError):
        qkv_shards(6, 6, 2, 4, 0)  # 6 query heads do not split over 4 ranks


def test_qkv_layer_loads_its_heads() -> None:
    q, k, v = _full(16, 3), _full(4, 3) + 100, _full(4, 3) + 200  # 8 q heads, 2 KV heads
    for rank in range(4):
        layer = QKVParallelLinear(3, 2, 8, 2, bias=False, parallel=_ctx(4, rank))
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        for part, tensor in enumerate((q, k, v)):
            layer.load_weight("weight", CheckpointTensor(tensor), part)
        head = rank * 2 // 4
        want = torch.cat([q[4 * rank : 4 * rank + 4], k[2 * head : 2 * head + 2],
                          v[2 * head : 2 * head + 2]])
        assert torch.equal(layer.weight, want)
        assert [t.shape[-1] for t in layer.split(torch.zeros(1, 8))] == [4, 2, 2]


def test_column_and_row_layers_load_their_slices() -> None:
    gate, up, down = _full(6, 4), _full(6, 4) + 50, _full(4, 6)
    bias = torch.arange(4.0)
    for rank in range(2):
        merged = MergedColumnParallelLinear(4, [6, 6], parallel=_ctx(2, rank))
        merged.load_weight("weight", CheckpointTensor(gate), 0)
        merged.load_weight("weight", CheckpointTensor(up), 1)
        rows = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(merged.weight, torch.cat([gate[rows], up[rows]]))
        column = ColumnParallelLinear(4, 6, bias=True, parallel=_ctx(2, rank))
        column.load_weight("bias", CheckpointTensor(torch.arange(6.0)))
        assert torch.equal(column.bias, torch.arange(6.0)[rows])
        row = RowParallelLinear(6, 4, bias=True, parallel=_ctx(2, rank))
        row.load_weight("weight", CheckpointTensor(down))
        row.load_weight("bias", CheckpointTensor(bias))
        assert torch.equal(row.weight, down[:, rows]) and torch.equal(row.bias, bias)


def test_layers_reject_wrong_full_shapes() -> None:
    merged = MergedColumnParallelLinear(4, [6, 6], parallel=_ctx(2, 0))
    with pytest.raises(ValueError, match=r"\(5, 4\) does not match expected \(6, 4\)"):
        merged.load_weight("weight", CheckpointTensor(_full(5, 4)), 1)
    with pytest.raises(ValueError, match="part"):
        merged.load_weight("weight", CheckpointTensor(_full(6, 4)), 2)
    row = RowParallelLinear(6, 4, parallel=_ctx(2, 1))
    with pytest.raises(ValueError, match="expected"):
        row.load_weight("weight", CheckpointTensor(_full(4, 3)))
    with pytest.raises(ValueError, match="bias"):
        row.load_weight("bias", CheckpointTensor(_full(4)))
    with pytest.raises(ValueError, match="part"):
        Linear(2, 2).load_weight("weight", CheckpointTensor(_full(2, 2)), 0)


def test_vocab_shards_pad_the_last_rank() -> None:
    table = _full(7, 2) + 1  # no zero rows, so padding shows
    shards = []
    for rank in range(2):
        emb = VocabParallelEmbedding(7, 2, _ctx(2, rank))
        emb.weight.data.fill_(float("nan"))
        emb.load_weight("weight", CheckpointTensor(table))
        assert (emb.rows_per_rank, emb.vocab_start) == (4, 4 * rank)
        shards.append(emb.weight.clone())
    assert torch.equal(shards[0], table[:4])
    assert torch.equal(shards[1], torch.cat([table[4:], torch.zeros(1, 2)]))
    head = ParallelLMHead(7, 2, _ctx(2, 1))
    head.tie(VocabParallelEmbedding(7, 2, _ctx(2, 1)))
    with pytest.raises(ValueError, match="expected"):
        head.load_weight("weight", CheckpointTensor(_full(8, 2)))


def test_single_rank_layers_are_plain() -> None:
    x = torch.randn(3, 6)
    row = RowParallelLinear(6, 4, bias=True)
    row.load_weight("weight", CheckpointTensor(torch.randn(4, 6)))
    row.load_weight("bias", CheckpointTensor(torch.randn(4)))
    assert torch.equal(row(x), torch.nn.functional.linear(x, row.weight, row.bias))
    emb = VocabParallelEmbedding(5, 3)
    emb.load_weight("weight", CheckpointTensor(torch.randn(5, 3)))
    ids = torch.tensor([4, 0, 2])
    assert torch.equal(emb(ids), emb.weight[ids])
    head = ParallelLMHead(5, 3)
    head.tie(emb)
    logits = head(torch.randn(2, 3, dtype=torch.float32))
    assert logits.shape == (2, 5) and logits.dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_lm_head_writes_into_out_with_the_same_values(rows: int) -> None:
    head = ParallelLMHead(1000, 64)
    head.load_weight("weight", CheckpointTensor(torch.randn(1000, 64)))
    hidden = torch.randn(rows, 64)
    want = head(hidden)
    pool = torch.full((64, 1000), float("nan"))
    got = head(hidden, pool[:rows])
    assert got.data_ptr() == pool.data_ptr()
    assert torch.equal(got, want)
    # Where it cannot write there (wrong shape, dtype) it returns a new tensor and leaves out.
    other = torch.zeros(rows + 1, 1000)
    assert torch.equal(head(hidden, other), want) and not other.any()
    half = torch.zeros(rows, 1000, dtype=torch.float64)
    assert torch.equal(head(hidden, half), want) and not half.any()
