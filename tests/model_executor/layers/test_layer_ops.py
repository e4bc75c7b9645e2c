"""Tests for vllm/model_executor/layers/layer_ops.py: the native per-layer ops against
float64 oracles and the torch versions they replace, row independence, thread counts, bad
indices, and the cases left to torch."""

from __future__ import annotations

import pytest
import torch

from vllm import _custom_ops
from vllm.attention.backends.torch_backend import write_kv as torch_write_kv
from vllm.model_executor.layers import layer_ops
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

pytestmark = pytest.mark.skipif(not _custom_ops.HAS_NATIVE,
                                reason="native only; HAS_NATIVE's test covers the build")


def _norm_oracle(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("hidden", [576, 67, 8, 3])
def test_rms_norm_matches_the_oracle_and_each_row_is_its_own(hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    # Strided rows (a slice of a wider buffer), as a fused product's output gives them.
    x = torch.randn(5, hidden + 7, generator=gen)[:, :hidden]
    res = torch.randn(5, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    out = layer_ops.rms_norm(x, weight, 1e-6)
    assert out is not None and out.is_contiguous()
    torch.testing.assert_close(out.double(), _norm_oracle(x, weight, 1e-6), rtol=2e-6, atol=1e-6)
    normed, summed = layer_ops.rms_norm(x, weight, 1e-6, res)
    assert torch.equal(summed, x + res)
    torch.testing.assert_close(normed.double(), _norm_oracle(x + res, weight, 1e-6), rtol=2e-6,
                               atol=1e-6)
    alone = layer_ops.rms_norm(x[3:4], weight, 1e-6, res[3:4])
    assert torch.equal(alone[0][0], normed[3]) and torch.equal(alone[1][0], summed[3])
    # The module takes the native path: the same bits.
    module = RMSNorm(hidden, 1e-6)
    module.weight.data.copy_(weight)
    assert torch.equal(module(x), out)


def test_rms_norm_is_the_same_for_any_thread_count() -> None:
    # Enough rows for the kernel to share them out over threads.
    x = torch.randn(2048, 576, generator=torch.Generator().manual_seed(0))
    weight = torch.rand(576) + 0.5
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(layer_ops.rms_norm(x, weight, 1e-5))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_rope_equals_the_torch_version_bit_for_bit() -> None:
    rope = RotaryEmbedding(64, 512, {"rope_theta": 100000.0, "rope_type": "default"})
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 9 * 64 + 2 * 3 * 64, generator=gen)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided views, as in the model
    positions = torch.tensor([0, 5, 511, 17, 300, 1, 2])
    native = layer_ops.rotary_neox(positions, q, k, rope.cos_cache, rope.sin_cache, 64)
    assert native is not None
    cos = rope.cos_cache[positions].unsqueeze(1)
    sin = rope.sin_cache[positions].unsqueeze(1)
    assert torch.equal(native[0], rope._rotate(q, cos, sin))
    assert torch.equal(native[1], rope._rotate(k, cos, sin))
    with pytest.raises(ValueError, match="outside the RoPE tables"):
        layer_ops.rotary_neox(torch.tensor([0, 512, 1, 1, 1, 1, 1]), q, k, rope.cos_cache,
                              rope.sin_cache, 64)


@pytest.mark.parametrize("width", [1536, 13])
def test_silu_and_mul_matches_the_oracle(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(4, 2 * width, generator=gen) * 8
    x[0, :4] = torch.tensor([100.0, -100.0, 88.5, -95.0])  # exp over- and underflow
    out = layer_ops.silu_and_mul(x)
    x64 = x.double()
    want = torch.nn.functional.silu(x64[:, :width]) * x64[:, width:]
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(SiluAndMul()(x), out)
    nan = x.clone()
    nan[1, 2] = float("nan")
    assert torch.isnan(layer_ops.silu_and_mul(nan)[1, 2])


def test_write_kv_equals_the_torch_write_and_refuses_bad_slots() -> None:
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 6, 4, 3, 8, generator=gen)
    want = cache.clone()
    qkv = torch.randn(5, 3 * 8 * 3, generator=gen)
    _, key, value = (t.view(5, 3, 8) for t in qkv.split([24, 24, 24], dim=-1))
    slots = torch.tensor([3, -1, 23, 0, 9])
    assert layer_ops.write_kv(key, value, cache, slots)
    torch_write_kv(key, value, want, slots)
    assert torch.equal(cache, want)
    for bad in (24, -2):
        with pytest.raises(ValueError, match="outside the KV cache"):
            layer_ops.write_kv(key, value, cache, torch.tensor([1, 2, bad, 3, 4]))
        assert torch.equal(cache, want)


def test_other_tensors_are_left_to_torch() -> None:
    x = torch.randn(3, 16)
    weight = torch.ones(16)
    assert layer_ops.rms_norm(x.double(), weight.double(), 1e-6) is None
    assert layer_ops.rms_norm(x.t(), torch.ones(3), 1e-6) is None  # columns, not rows
    tracked = weight.clone().requires_grad_()
    assert layer_ops.rms_norm(x, tracked, 1e-6) is None  # autograd needs torch's ops
    with torch.no_grad():
        assert layer_ops.rms_norm(x, tracked, 1e-6) is not None
    assert layer_ops.silu_and_mul(x.to(torch.bfloat16)) is None
    assert layer_ops.rotary_neox(torch.arange(3, dtype=torch.int32), x, x, x, x, 4) is None
    module = RMSNorm(16)
    module.weight.requires_grad_()
    y = module(x)
    y.sum().backward()  # the torch path keeps the graph
    assert module.weight.grad is not None
