"""GPTQ layers on 1, 2 and 4 tensor-parallel ranks against x @ W_dequantized^T.

The packed tensors come from tests/utils_quant.py (GPTQ's packing rules); with desc_act
the rows' groups are scattered, so a row-parallel rank must keep every group's scales."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.layers.quantization.utils_layers import column_output, row_output
from tests.utils_quant import gptq_tensors
from vllm.model_executor.layers.quantization.gptq import GptqConfig

IN, OUT, GROUP = 128, 64, 32


def _method(act_order: bool, sym: bool):
    return GptqConfig({"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                       "desc_act": act_order, "sym": sym}).method


@pytest.mark.parametrize("act_order,sym", [(False, True), (True, False)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_layers_match_dequantized(act_order: bool, sym: bool, tp: int) -> None:
    gen = torch.Generator().manual_seed(tp)
    x = torch.randn(5, IN, generator=gen)
    order = torch.randperm(IN, generator=gen) if act_order else None
    gate, gate_w = gptq_tensors(torch.randn(OUT, IN, generator=gen), GROUP, sym, order)
    up, up_w = gptq_tensors(torch.randn(OUT, IN, generator=gen), GROUP, sym, order)
    got = column_output(_method(act_order, sym), [{**gate, "out_size": OUT},
                                                  {**up, "out_size": OUT}], IN, x, tp)
    torch.testing.assert_close(got, x @ torch.cat([gate_w, up_w]).t(), rtol=0, atol=1e-4)

    down, down_w = gptq_tensors(torch.randn(OUT, IN, generator=gen), GROUP, sym,
                                torch.randperm(IN, generator=gen) if act_order else None)
    got = row_output(_method(act_order, sym), down, IN, OUT, x, tp)
    torch.testing.assert_close(got, x @ down_w.t(), rtol=0, atol=1e-4)


def test_fused_parts_with_different_orders_are_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    parts = [{**gptq_tensors(torch.randn(OUT, IN, generator=gen), GROUP, True,
                             torch.randperm(IN, generator=gen))[0], "out_size": OUT}
             for _ in range(2)]
    with pytest.raises(ValueError, match="g_idx differs from the other parts"):
        column_output(_method(True, True), parts, IN, torch.zeros(1, IN), 1)


def test_unaligned_tensor_parallel_split_is_refused() -> None:
    gen = torch.Generator().manual_seed(0)
    down, _ = gptq_tensors(torch.randn(OUT, IN, generator=gen), GROUP, True)
    # 128 input rows over 8 ranks: 16 each, less than a group of 32.
    with pytest.raises(ValueError, match=r"not a multiple of the packing \(8\) and the group "
                                         r"size \(32\)"):
        row_output(_method(False, True), down, IN, OUT, torch.zeros(1, IN), 8)
