"""FP8 weights: per-row quantization at load (--quantization fp8), the dequantizing
matmul, and per-rank scales under tensor parallelism."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.layers.quantization.utils_layers import column_output, row_output
from vllm.model_executor.layers.quantization.fp8 import (
    FP8_MAX,
    Fp8LinearMethod,
    _scaled_mm_ok,
    fp8_matmul,
    quantize_rows,
)


def test_quantize_rows_keeps_each_rows_range() -> None:
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    w[3] *= 100  # rows of very different magnitudes keep their own scales
    w[5] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (8,)
    assert torch.allclose(q.float().abs().amax(1)[[0, 3]], torch.full((2,), FP8_MAX))
    deq = q.float() * scale.unsqueeze(1)
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per weight.
    assert ((deq - w).abs() <= w.abs() / 16 + 1e-6).all()
    assert torch.equal(deq[5], torch.zeros(32))


def test_fp8_matmul_on_cpu_is_the_dequantized_matmul() -> None:
    gen = torch.Generator().manual_seed(1)
    q, scale = quantize_rows(torch.randn(16, 32, generator=gen))
    x = torch.randn(3, 32, generator=gen)
    want = x @ (q.float() * scale.unsqueeze(1)).t()
    torch.testing.assert_close(fp8_matmul(x, q, scale), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_at_load_per_rank(tp: int) -> None:
    gen = torch.Generator().manual_seed(tp)
    w = torch.randn(48, 64, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    method = Fp8LinearMethod(serialized=False)
    got = column_output(method, [{"weight": w, "out_size": 48}], 64, x, tp)
    q, scale = quantize_rows(w)
    torch.testing.assert_close(got, x @ (q.float() * scale.unsqueeze(1)).t(), rtol=0,
                               atol=1e-4)
    # Row-parallel ranks quantize their own columns: scales per (row, rank).
    want = sum(
        x[:, c] @ (lambda qs: qs[0].float() * qs[1].unsqueeze(1))(quantize_rows(w[:, c])).t()
        for c in torch.arange(64).chunk(tp)
    )
    torch.testing.assert_close(row_output(method, {"weight": w}, 64, 48, x, tp), want, rtol=0,
                               atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 tensor cores")
@pytest.mark.parametrize("per_token", [True, False])
def test_scaled_mm_is_close_to_the_dequantized_matmul(per_token: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    q, scale = quantize_rows(torch.randn(64, 128, generator=gen))
    q, scale = q.cuda(), scale.cuda()
    x = torch.randn(2, 7, 128, generator=gen).cuda().bfloat16()
    assert _scaled_mm_ok(x, q)
    got = fp8_matmul(x, q, scale, per_token).float()
    want = x.float() @ (q.float() * scale.unsqueeze(1)).t()
    assert got.shape == (2, 7, 64)
    # The activations are quantized to e4m3 too (3 mantissa bits): a few percent.
    assert ((got - want).norm() / want.norm()).item() < 0.05
