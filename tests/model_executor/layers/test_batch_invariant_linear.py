"""Row plans: with every product planned, a row's numbers do not depend on how many rows
share the step (from the plan's padding on), at the shapes of the demo model and at the
full Qwen vocabulary, with and without the native kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm import _custom_ops
from vllm.model_executor.layers import batch_invariant_linear
from vllm.model_executor.layers.column_major import make_column_major
from vllm.model_executor.layers.linear import Linear, MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

QWEN_VOCAB = 151_936


class _Tiny(nn.Module):
    """The shapes of the demo model's products: hidden 256, MLP 768, a wide tied head."""

    def __init__(self, vocab: int = 4096, hidden: int = 256, mlp: int = 768) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(vocab, hidden)
        self.gate_up = MergedColumnParallelLinear(hidden, [mlp, mlp])
        self.down = RowParallelLinear(mlp, hidden, bias=True)
        self.lm_head = ParallelLMHead(vocab, hidden)
        self.lm_head.tie(self.embed)
        gen = torch.Generator().manual_seed(0)
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        h = h + self.down(torch.nn.functional.silu(gate) * up)
        return self.lm_head(h)


def _without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_custom_ops, "_library", lambda: None)


def _head(vocab: int, hidden: int) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden)
    head.weight.data.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(2)))
    assert make_column_major(head)
    return head


def _assert_rows_independent(run, hidden: torch.Tensor, pad_to: int, counts) -> None:
    """run(x) for the first `rows` rows, padded to pad_to, equals its rows of run(all)."""
    full = run(hidden)
    for rows in counts:
        padded = hidden[: max(rows, pad_to)]
        assert torch.equal(run(padded)[:rows], full[:rows]), f"{rows} rows (padded to {pad_to})"


@pytest.mark.parametrize("native", [True, False])
def test_a_planned_models_rows_do_not_depend_on_their_batch(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not native:
        _without_native(monkeypatch)
    model = _Tiny()
    assert make_column_major(model)
    pad_to = batch_invariant_linear.plan_model(model)
    ids = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _assert_rows_independent(lambda h: model(h), ids, pad_to, range(1, 41))
        # The runner's logits path writes into a reused buffer: same numbers.
        hidden = model.embed(ids)
        out = torch.empty(64, 4096)
        for rows in (1, 2, 5, 16, 17, 40):
            rows = max(rows, pad_to)
            assert torch.equal(model.lm_head(hidden[:rows], out=out[:rows]),
                               model.lm_head(hidden[:rows])), rows


@pytest.mark.parametrize("native", [True, False])
def test_the_full_vocabulary_head_keeps_rows_independent(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 151,936 columns a BLAS may switch kernels at other row counts than at 4,096."""
    if not native:
        _without_native(monkeypatch)
    head = _head(QWEN_VOCAB, 64)
    pad_to = batch_invariant_linear.plan_model(head)
    assert head.row_plan is not None and pad_to == head.row_plan.min_rows
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        _assert_rows_independent(head, hidden, pad_to, (*range(1, 18), 31, 32, 33))


@pytest.mark.skipif(not _custom_ops.HAS_NATIVE,
                    reason="native only; test_custom_ops covers whether it must exist")
def test_the_native_kernel_takes_the_blas_order_so_nothing_is_padded() -> None:
    """The point of the native kernel: a batch of one pays one row of the head. Fails on a
    CPU whose BLAS sums in an order no chunking reproduces (the plan then pads instead)."""
    head = _head(QWEN_VOCAB, 256)
    plan = batch_invariant_linear.plan(head.weight.t())
    assert plan.chunk is not None and plan.min_rows == 1, plan


def test_without_the_native_kernel_the_plan_pads_to_where_the_blas_agrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_native(monkeypatch)
    weight_t = _head(QWEN_VOCAB, 64).weight.t()
    plan = batch_invariant_linear.plan(weight_t)
    assert plan.chunk is None
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    full = torch.mm(x, weight_t)
    for rows in range(plan.min_rows, 41):
        assert torch.equal(batch_invariant_linear.multiply(x[:rows], weight_t, plan), full[:rows]), rows


def test_a_blas_that_changes_its_rounding_past_the_native_rows_is_padded_instead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The native kernel stands in for the BLAS's few-row kernels only; if the BLAS itself
    rounds 17 rows (the first count it keeps) unlike 32, the plan must pad past that."""
    weight_t = _head(500, 32).weight.t()
    real_mm = torch.mm

    def moody_mm(a: torch.Tensor, b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        y = real_mm(a, b, **kwargs)
        return y.mul_(1 + 2**-20) if a.shape[0] == batch_invariant_linear.NATIVE_MAX_ROWS + 1 else y

    monkeypatch.setattr(torch, "mm", moody_mm)
    assert batch_invariant_linear.plan(weight_t) == batch_invariant_linear.RowPlan(
        chunk=None, min_rows=batch_invariant_linear.NATIVE_MAX_ROWS + 2)


@pytest.mark.skipif(not _custom_ops.HAS_NATIVE,
                    reason="native only; test_custom_ops covers whether it must exist")
def test_multiply_sends_many_rows_to_the_blas_and_writes_out() -> None:
    weight_t = _head(1000, 32).weight.t()
    plan = batch_invariant_linear.RowPlan(chunk=32, min_rows=1)
    many = torch.randn(batch_invariant_linear.NATIVE_MAX_ROWS + 1, 32)
    assert torch.equal(batch_invariant_linear.multiply(many, weight_t, plan), torch.mm(many, weight_t))
    out = torch.empty(2, 1000)
    few = many[:2]
    assert batch_invariant_linear.multiply(few, weight_t, plan, out) is out
    assert torch.equal(out, _custom_ops.dense_rows(few, weight_t, 32, torch.empty(2, 1000)))


@pytest.mark.skipif(not _custom_ops.HAS_NATIVE,
                    reason="native only; test_custom_ops covers whether it must exist")
@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
def test_the_native_kernel_takes_the_wide_rows_only_on_an_avx2_cpu(
    monkeypatch: pytest.MonkeyPatch, capability: str
) -> None:
    """Whichever kernel a plan picks for 17-32 rows, every row equals the BLAS's many-row
    result; the native kernel gets those rows only where the BLAS is no wider (AVX2)."""
    bil = batch_invariant_linear
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    wide = capability == "AVX2"
    weight_t = _head(1000, 64).weight.t()
    plan = bil.plan(weight_t)
    assert plan.chunk is not None
    assert plan.native_rows == (bil.NATIVE_WIDE_ROWS if wide else bil.NATIVE_MAX_ROWS)
    native_rows: list[int] = []
    dense_rows = _custom_ops.dense_rows

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        native_rows.append(x.shape[0])
        return dense_rows(x, *args)

    monkeypatch.setattr(_custom_ops, "dense_rows", spy)
    x = torch.randn(bil.NATIVE_WIDE_ROWS + 8, 64, generator=torch.Generator().manual_seed(5))
    full = torch.mm(x, weight_t)
    for rows in (1, 16, 17, 32, 33):
        assert torch.equal(bil.multiply(x[:rows], weight_t, plan), full[:rows]), rows
    assert native_rows == ([1, 16, 17, 32] if wide else [1, 16])


def test_plan_model_plans_dense_float32_matrices_only_and_probes_a_shape_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = Linear(8, 16)
            self.b = Linear(8, 16)
            self.row_major = Linear(8, 16)
            self.float64 = Linear(8, 16)
            self.embed = VocabParallelEmbedding(16, 8)

    model = Mixed()
    for p in model.parameters():
        p.data.normal_()
    model.float64.weight.data = model.float64.weight.data.double()
    for layer in (model.a, model.b, model.float64, model.embed):
        layer.weight.data = layer.weight.data.t().contiguous().t()
    probes = []
    real_plan = batch_invariant_linear.plan
    monkeypatch.setattr(batch_invariant_linear, "plan",
                        lambda w: probes.append(tuple(w.shape)) or real_plan(w))
    pad_to = batch_invariant_linear.plan_model(model)
    assert probes == [(8, 16)]
    assert model.a.row_plan is model.b.row_plan and pad_to == model.a.row_plan.min_rows
    assert model.row_major.row_plan is None and model.float64.row_plan is None
    assert not hasattr(model.embed, "row_plan")
