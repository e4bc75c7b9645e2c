"""AWQ (GEMM packing) layers on 1 and 2 tensor-parallel ranks against x @ W^T of the
dequantized weight, and AWQ's interleaved column order."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.layers.quantization.utils_layers import column_output, row_output
from tests.utils_quant import awq_tensors
from vllm.model_executor.layers.quantization.awq import AwqConfig, unpack_awq

IN, OUT, GROUP = 64, 128, 16


def _method():
    return AwqConfig({"quant_method": "awq", "bits": 4, "group_size": GROUP,
                      "zero_point": True, "version": "gemm"}).method


def test_unpack_follows_the_interleaved_order() -> None:
    # Word slots hold columns 0, 2, 4, 6, 1, 3, 5, 7: slot i of value i + 1.
    word = sum((i + 1) << (4 * i) for i in range(8))
    word -= 1 << 32  # the top slot's bit 31 set: a negative int32
    got = unpack_awq(torch.tensor([[word]], dtype=torch.int32))
    assert got.tolist() == [[1, 5, 2, 6, 3, 7, 4, 8]]


@pytest.mark.parametrize("tp", [1, 2])
def test_column_and_row_layers_match_dequantized(tp: int) -> None:
    gen = torch.Generator().manual_seed(tp)
    x = torch.randn(3, IN, generator=gen)
    q, q_w = awq_tensors(torch.randn(OUT, IN, generator=gen), GROUP)
    k, k_w = awq_tensors(torch.randn(64, IN, generator=gen), GROUP)
    got = column_output(_method(), [{**q, "out_size": OUT}, {**k, "out_size": 64}], IN, x, tp)
    torch.testing.assert_close(got, x @ torch.cat([q_w, k_w]).t(), rtol=0, atol=1e-4)
    o, o_w = awq_tensors(torch.randn(IN, OUT, generator=gen), GROUP)
    x2 = torch.randn(3, OUT, generator=torch.Generator().manual_seed(99))
    torch.testing.assert_close(row_output(_method(), o, OUT, IN, x2, tp), x2 @ o_w.t(),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("field,value,match", [
    ("version", "gemv", r"version: 'gemv' is not supported"),
    ("zero_point", False, r"zero_point: false is not supported"),
    ("group_size", 0, r"group_size: 0 must be a positive integer or -1"),
])
def test_unsupported_configs_are_named(field, value, match) -> None:
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    with pytest.raises(ValueError, match=match):
        AwqConfig({**config, field: value})
