"""The fused MoE layer against a naive per-token loop, its routing, and what each
tensor-parallel rank loads and computes (no processes: the all-reduce is a sum here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.distributed.parallel_state import ParallelContext, ParallelLayout
from vllm.model_executor.layers.fused_moe import (
    MIXTRAL_EXPERT_NAMES,
    FusedMoE,
    fused_experts,
    select_experts,
)
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor

HIDDEN, INTER = 16, 12


def _ctx(tp: int, rank: int) -> ParallelContext:
    return ParallelContext(ParallelLayout(tp_size=tp, rank=rank))


def _experts(num_experts: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(gate [I, H], up [I, H], down [H, I]) of each expert, as a checkpoint holds them."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(INTER, HIDDEN, generator=gen) / HIDDEN**0.5,
         torch.randn(INTER, HIDDEN, generator=gen) / HIDDEN**0.5,
         torch.randn(HIDDEN, INTER, generator=gen) / INTER**0.5)
        for _ in range(num_experts)
    ]


def _naive(x, logits, experts, top_k: int, renormalize: bool) -> torch.Tensor:
    """One token at a time: softmax, its top-k experts, their weighted outputs summed."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].float(), dim=-1)
        weights, ids = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist()):
            gate, up, down = experts[e]
            out[t] += w * (down @ (F.silu(gate @ x[t]) * (up @ x[t])))
    return out


def _load(layer: FusedMoE, experts) -> FusedMoE:
    gate, up, down = layer.expert_names
    named = {}
    for e, (g, u, d) in enumerate(experts):
        named.update({f"{e}.{gate}.weight": g, f"{e}.{up}.weight": u, f"{e}.{down}.weight": d})
    for param_name in ("w13_weight", "w2_weight"):
        for ckpt_name, part in layer.checkpoint_parts(param_name):
            layer.load_weight(param_name, CheckpointTensor(named.pop(ckpt_name)), part)
    assert not named  # checkpoint_parts names every expert tensor exactly once
    return layer


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_layer_matches_naive_loop(top_k: int, renormalize: bool) -> None:
    num_experts, tokens = 6, 23
    experts = _experts(num_experts, seed=top_k)
    layer = _load(FusedMoE(num_experts, top_k, HIDDEN, INTER, renormalize), experts)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    logits = 2 * torch.randn(tokens, num_experts, generator=gen)
    logits[:, 5] = -1e4  # an expert no token picks must be skipped, not mis-sliced
    got = layer(x, logits)
    want = _naive(x, logits, experts, top_k, renormalize)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_renormalize_changes_the_output() -> None:
    # Guards the test above: the two settings must be distinguishable on these inputs.
    experts = _experts(4, seed=0)
    x, logits = torch.randn(5, HIDDEN), torch.randn(5, 4)
    plain = _load(FusedMoE(4, 2, HIDDEN, INTER, False), experts)(x, logits)
    renorm = _load(FusedMoE(4, 2, HIDDEN, INTER, True), experts)(x, logits)
    assert (plain - renorm).abs().max() > 1e-3


def test_select_experts_weights_and_ids() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]], dtype=torch.bfloat16)
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits.float(), dim=-1)
    assert ids.tolist() == [[1, 2]] and weights.dtype == torch.float32
    torch.testing.assert_close(weights, probs[:, [1, 2]])
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))


def test_no_tokens() -> None:
    w13, w2 = torch.randn(3, 2 * INTER, HIDDEN), torch.randn(3, HIDDEN, INTER)
    out = fused_experts(torch.empty(0, HIDDEN), w13, w2, torch.empty(0, 2),
                        torch.empty(0, 2, dtype=torch.int64))
    assert out.shape == (0, HIDDEN)


def test_tensor_parallel_shards_sum_to_the_whole() -> None:
    experts = _experts(4, seed=3)
    whole = _load(FusedMoE(4, 2, HIDDEN, INTER, True, expert_names=MIXTRAL_EXPERT_NAMES),
                  experts)
    x, logits = torch.randn(9, HIDDEN), torch.randn(9, 4)
    weights, ids = select_experts(logits, 2, True)
    partial_sum = torch.zeros(9, HIDDEN)
    for rank in range(2):
        layer = _load(FusedMoE(4, 2, HIDDEN, INTER, True, _ctx(2, rank),
                               MIXTRAL_EXPERT_NAMES), experts)
        half = INTER // 2
        rows = slice(rank * half, (rank + 1) * half)
        assert layer.w13_weight.shape == (4, 2 * half, HIDDEN)
        gate, up, down = experts[1]
        assert torch.equal(layer.w13_weight[1], torch.cat([gate[rows], up[rows]]))
        assert torch.equal(layer.w2_weight[1], down[:, rows])
        # What forward computes before its all-reduce.
        partial_sum += fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids)
    torch.testing.assert_close(partial_sum, whole(x, logits), atol=1e-5, rtol=1e-5)


def test_bad_configs_and_tensors_are_named() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(4, 5, HIDDEN, INTER, True)
    with pytest.raises(ValueError, match="num_experts"):
        FusedMoE(0, 1, HIDDEN, INTER, True)
    with pytest.raises(ValueError, match="split"):
        FusedMoE(4, 2, HIDDEN, 5, True, _ctx(2, 0))  # I = 5 does not split over 2 ranks
    layer = FusedMoE(4, 2, HIDDEN, INTER, True)
    with pytest.raises(ValueError, match="expected"):
        layer.load_weight("w13_weight", CheckpointTensor(torch.zeros(INTER + 1, HIDDEN)), 0)
    with pytest.raises(ValueError, match="part 8"):
        layer.load_weight("w13_weight", CheckpointTensor(torch.zeros(INTER, HIDDEN)), 8)
    with pytest.raises(ValueError, match="bias"):
        layer.checkpoint_parts("bias")


def _fp8(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 codes, checkpoint scale, dequantized weight) of a per-row or per-tensor FP8 w."""
    amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (w / scale).to(torch.float8_e4m3fn)
    return q, scale.reshape(1) if per_tensor else scale, q.float() * scale


@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_experts_shards_sum_to_the_dequantized_whole(per_tensor: bool) -> None:
    from vllm.model_executor.layers.linear import deferred_weights

    experts = _experts(4, seed=5)
    quantized = [[_fp8(w, per_tensor) for w in expert] for expert in experts]
    dequantized = [tuple(d for _, _, d in expert) for expert in quantized]
    whole = _load(FusedMoE(4, 2, HIDDEN, INTER, True), dequantized)
    x, logits = torch.randn(7, HIDDEN), torch.randn(7, 4)
    weights, ids = select_experts(logits, 2, True)
    partial_sum = torch.zeros(7, HIDDEN)
    for rank in range(2):
        with deferred_weights():
            layer = FusedMoE(4, 2, HIDDEN, INTER, True, _ctx(2, rank))
        assert layer.w13_weight.is_meta
        layer.materialize(fp8=True, per_tensor_scales=per_tensor)
        gate, up, down = layer.expert_names
        named = {}
        for e, expert in enumerate(quantized):
            for name, (q, scale, _) in zip((gate, up, down), expert):
                named.update({f"{e}.{name}.weight": q, f"{e}.{name}.weight_scale": scale})
        for param_name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
            for ckpt_name, part in layer.checkpoint_parts(param_name):
                layer.load_weight(param_name, CheckpointTensor(named.pop(ckpt_name)), part)
        assert not named and layer.w13_weight.dtype == torch.float8_e4m3fn
        partial_sum += fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids,
                                     layer.w13_weight_scale, layer.w2_weight_scale)
    torch.testing.assert_close(partial_sum, whole(x, logits), atol=1e-5, rtol=1e-5)
