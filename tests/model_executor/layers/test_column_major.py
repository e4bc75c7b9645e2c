"""Column-major dense weights: the layers compute what they did, and the runner pads as the
row plans ask only when every matrix of the model is column-major."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm.model_executor.layers.column_major import make_column_major
from vllm.model_executor.layers.linear import Linear, MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding


class _Tiny(nn.Module):
    """The shapes of the demo model's products: hidden 256, MLP 768, a wide tied head."""

    def __init__(self, vocab: int = 4096, hidden: int = 256, mlp: int = 768) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(vocab, hidden)
        self.gate_up = MergedColumnParallelLinear(hidden, [mlp, mlp])
        self.down = RowParallelLinear(mlp, hidden)
        self.head = ParallelLMHead(vocab, hidden)
        self.head.tie(self.embed)
        self.norm = nn.Parameter(torch.ones(hidden), requires_grad=False)
        gen = torch.Generator().manual_seed(0)
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        h = h + self.down(torch.nn.functional.silu(gate) * up)
        return self.head(h)


def test_values_and_tying_survive_the_relayout() -> None:
    model = _Tiny()
    ids = torch.arange(0, 4096, 97)
    with torch.inference_mode():
        before = model(ids)
        weights = {n: p.clone() for n, p in model.named_parameters()}
        assert make_column_major(model)
        after = model(ids)
    assert model.head.weight is model.embed.weight
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
        if p.dim() == 2:
            assert p.t().is_contiguous() and not p.is_contiguous(), name
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_a_matrix_it_cannot_relay_keeps_the_larger_padding() -> None:
    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = Linear(8, 8)
            self.experts = nn.Parameter(torch.zeros(4, 8, 8), requires_grad=False)

    model = Experts()
    assert not make_column_major(model)
    assert model.dense.weight.t().is_contiguous()  # what it could relay, it did

    class Tower(nn.Module):
        multiplies_step_rows = False  # a vision tower: one image's patches, not step rows

        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

    class WithTower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = Linear(8, 8)
            self.visual = Tower()

    assert make_column_major(WithTower())


@pytest.mark.parametrize("lora", [False, True])
def test_runner_pads_cpu_steps_as_the_row_plans_ask_unless_adapters_multiply(lora: bool) -> None:
    from vllm import _custom_ops
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    kwargs = {"enable_lora": True, "max_lora_rank": 8} if lora else {}
    config = EngineArgs(model="demo-tiny", max_model_len=256, **kwargs).create_engine_config()
    assert (config.lora_config is not None) == lora
    runner = GPUModelRunner(config)
    runner.load_model()
    dense = [m for m in runner.model.modules() if isinstance(m, (Linear, ParallelLMHead))]
    assert dense and all(m.row_plan is not None for m in dense)
    assert runner.min_rows == (16 if lora else max(m.row_plan.min_rows for m in dense))
    assert runner.logits_min_rows == runner.model.lm_head.row_plan.min_rows
    if _custom_ops.HAS_NATIVE:  # nothing to pad: a batch of one computes one row
        assert runner.logits_min_rows == 1 and runner.min_rows == (16 if lora else 1)
