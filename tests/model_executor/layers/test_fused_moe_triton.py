"""The Triton grouped-GEMM MoE path against the torch path. Without CUDA the kernel runs in
Triton's interpreter, which tests/conftest.py switches on before triton is imported."""

from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
triton = pytest.importorskip("triton")

from vllm.model_executor.layers.fused_moe import (  # noqa: E402
    FusedMoE,
    fused_experts,
    select_experts,
)
from vllm.model_executor.layers.fused_moe_triton import triton_fused_experts  # noqa: E402
from vllm.model_executor.layers.triton_grouped_gemm import (  # noqa: E402
    _grouped_gemm_kernel,
    align_by_expert,
)

if DEVICE.type == "cpu" and not isinstance(
    _grouped_gemm_kernel, triton.runtime.interpreter.InterpretedFunction
):
    raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set (see "
                       "tests/conftest.py)")

HIDDEN, INTER = 48, 40  # not multiples of the 32-wide blocks: the edge masks matter


def _weights(num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    return w13.to(DEVICE), w2.to(DEVICE)


def test_align_by_expert_gives_each_block_one_expert() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 1]])
    pair_ids, block_expert = align_by_expert(ids, num_experts=5, block_m=4)
    num_pairs = ids.numel()
    assert block_expert.numel() == -(-(num_pairs + 5 * 3) // 4)  # the worst case
    real = pair_ids[pair_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    flat = ids.reshape(-1)
    for b, expert in enumerate(block_expert.tolist()):
        rows = pair_ids[4 * b : 4 * b + 4]
        rows = rows[rows < num_pairs]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == expert).all()
    # Expert 4 has no pairs and gets no block; 0 (2 pairs), 1, 2 (4), 3 get one each.
    assert block_expert.tolist()[:4] == [0, 1, 2, 3] and set(block_expert.tolist()[4:]) == {-1}


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_triton_matches_torch_path(top_k: int, num_tokens: int) -> None:
    num_experts = 6
    w13, w2 = _weights(num_experts, seed=top_k)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(DEVICE)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    logits[:, 1] = -1e4  # an expert without pairs
    weights, ids = select_experts(logits, top_k, renormalize=top_k > 1)
    want = fused_experts(x, w13, w2, weights, ids)
    got = triton_fused_experts(x, w13, w2, weights, ids)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_layer_uses_the_backend_the_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    w13, w2 = _weights(4, seed=9)
    layers = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("VLLM_MOE_BACKEND", backend)
        layer = FusedMoE(4, 2, HIDDEN, INTER, renormalize=True).to(DEVICE)
        assert layer.backend == backend
        layer.w13_weight.data.copy_(w13)
        layer.w2_weight.data.copy_(w2)
        layers[backend] = layer
    x, logits = torch.randn(9, HIDDEN).to(DEVICE), torch.randn(9, 4).to(DEVICE)
    torch.testing.assert_close(layers["triton"](x, logits), layers["torch"](x, logits),
                               atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("VLLM_MOE_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="VLLM_MOE_BACKEND"):
        FusedMoE(4, 2, HIDDEN, INTER, renormalize=True)
