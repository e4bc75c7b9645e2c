"""The Triton 4-bit matmul against each format's torch dequantization, on shapes that are
not multiples of the blocks. Without CUDA the kernel runs in Triton's interpreter, which
tests/conftest.py switches on before triton is imported."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.model_executor.layers.quantization.test_compressed_tensors import (  # noqa: E402
    _int4_tensors,
)
from tests.utils_quant import gptq_tensors  # noqa: E402
from vllm.model_executor.layers.linear import RowParallelLinear, deferred_weights  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors import (  # noqa: E402
    CompressedInt4Method,
)
from vllm.model_executor.layers.quantization.gptq import GptqLinearMethod  # noqa: E402
from vllm.model_executor.layers.quantization.int4_triton import (  # noqa: E402
    _int4_matmul_kernel,
    int4_matmul,
)
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor  # noqa: E402

if not torch.cuda.is_available() and not isinstance(
    _int4_matmul_kernel, triton.runtime.interpreter.InterpretedFunction
):
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set (see "
                       "tests/conftest.py)")

IN, OUT = 64, 40  # 40 outputs: a partial block of 32
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _layer(method, tensors: dict[str, torch.Tensor]):
    with deferred_weights(), torch.device(DEVICE):
        layer = RowParallelLinear(IN, OUT)
        layer.materialize(method)
    for name, value in tensors.items():
        layer.load_weight(name, CheckpointTensor(value))
    return layer


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_w4a16_kernel_matches_dequantized(symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors, w = _int4_tensors(torch.randn(OUT, IN, generator=gen), 16, symmetric)
    method = CompressedInt4Method(16, symmetric)
    layer = _layer(method, tensors)
    x = torch.randn(5, IN, generator=gen)
    got = int4_matmul(x.to(DEVICE), **method.kernel_args(layer)).cpu()
    torch.testing.assert_close(got, x @ w.t(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_kernel_matches_dequantized(act_order: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(IN, generator=gen) if act_order else None
    tensors, w = gptq_tensors(torch.randn(OUT, IN, generator=gen), 16, False, order)
    method = GptqLinearMethod(16, act_order, zero_offset=1)
    layer = _layer(method, tensors)
    x = torch.randn(3, IN, generator=gen)
    got = int4_matmul(x.to(DEVICE), **method.kernel_args(layer)).cpu()
    torch.testing.assert_close(got, x @ w.t(), rtol=0, atol=1e-4)
