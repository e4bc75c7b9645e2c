"""The sampler's fixed-shape path (ops/dense_sampling.py): same tokens as the default path,
and structurally what a CUDA graph can capture, checked by counting operations (never by
timing): no operation that makes the host wait, run on "meta" tensors, where such an
operation cannot run at all; an operation count that does not grow with the batch; one
operation sequence whatever each row's mode."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.sample.metadata import GrammarMask, SamplingMetadata
from vllm.v1.sample.ops.dense_sampling import (
    DenseRows,
    Plan,
    apply_dense_bitmask,
    sample_dense,
)
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.op_audit import OpAudit

VOCAB = 1000  # <= the default path's 1024 top-p candidates: both paths then sort alike
MODES = ["greedy", "temperature", "min_p", "top_k", "top_p", "top_k_top_p", "all"]


def _column(values: list, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(dev)


CPU = torch.device("cpu")


def metadata(n: int, mode: str, dev: torch.device = CPU, edits: bool = False,
             seed: int = 0) -> SamplingMetadata:
    """Rows of `mode` ("mixed": every mode in turn, greedy rows included); seeded rows on
    every third row. `edits` adds every token edit and logprobs on row 0."""
    modes = [MODES[i % len(MODES)] if mode == "mixed" else mode for i in range(n)]
    temp = [0.0 if m == "greedy" else 0.5 + 0.1 * (i % 7) for i, m in enumerate(modes)]
    top_k = [7 + i % 5 if m in ("top_k", "top_k_top_p", "all") else 0
             for i, m in enumerate(modes)]
    top_p = [0.6 if m in ("top_p", "top_k_top_p", "all") else 1.0 for m in modes]
    min_p = [0.05 if m in ("min_p", "all") else 0.0 for m in modes]
    fields = {
        "all_greedy": all(m == "greedy" for m in modes),
        "all_random": not any(m == "greedy" for m in modes),
        "top_k": _column(top_k, torch.int32, dev) if any(top_k) else None,
        "top_p": _column(top_p, torch.float32, dev) if min(top_p) < 1.0 else None,
        "min_p": _column(min_p, torch.float32, dev) if any(min_p) else None,
        "seeds": [100 + i if i % 3 == 0 else None for i in range(n)],
        "output_positions": [i % 4 for i in range(n)],
    }
    if fields["all_greedy"]:
        fields["temperature"] = None
    if edits:
        fields.update(
            no_penalties=False,
            repetition_penalties=_column([1.3] * n, torch.float32, dev),
            frequency_penalties=_column([0.2] * n, torch.float32, dev),
            presence_penalties=_column([0.1] * n, torch.float32, dev),
            prompt_token_ids=_column([[1, 2, 3]] * n, torch.int64, dev),
            output_token_ids=[[4, 5]] * n,
            min_tokens={0: (3, {9, 10})},
            max_num_logprobs=2,
            allowed_token_ids={0: list(range(0, VOCAB, 3))},
            logit_bias={0: ([6, 7], [2.0, -1.0])},
            bad_words={0: [[11], [4, 12]]},
            recent_output_token_ids=_column([[5]] * n, torch.int64, dev),
        )
    return SamplingMetadata.plain(_column(temp, torch.float32, dev),
                                  torch.Generator().manual_seed(seed), **fields)


def _logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 3


def test_fixed_shape_path_gives_the_default_paths_tokens() -> None:
    for seed, mode in enumerate(MODES + ["mixed"]):
        logits = _logits(16, seed)
        want = Sampler(fixed_shape=False)(logits.clone(), metadata(16, mode, seed=seed))
        got = Sampler(fixed_shape=True)(logits.clone(), metadata(16, mode, seed=seed))
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids), mode


def test_fixed_shape_path_with_token_edits_grammar_and_logprobs() -> None:
    logits = _logits(12, 5)
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(-(2**31), 2**31 - 1, (12, (VOCAB + 31) // 32), generator=g)
    rows = torch.arange(12)
    rows[1::2] = -1
    grammar = GrammarMask(bits.to(torch.int32).numpy(), rows.numpy())
    outs = []
    for fixed in (False, True):
        md = metadata(12, "mixed", edits=True, seed=5)
        md.grammar_mask = grammar
        outs.append(Sampler(fixed_shape=fixed)(logits.clone(), md))
    want, got = outs
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert torch.equal(got.logprobs.token_ids, want.logprobs.token_ids)
    assert torch.equal(got.logprobs.logprobs, want.logprobs.logprobs)
    assert torch.equal(got.logprobs.ranks, want.logprobs.ranks)


def _audit(n: int, mode: str, fixed: bool | None, device: str) -> OpAudit:
    dev = torch.device(device)
    audit = OpAudit(device)
    logits = torch.empty(n, VOCAB, device=dev) if device == "meta" else _logits(n, 0)
    with audit:
        Sampler(fixed_shape=fixed)(logits, metadata(n, mode, dev, edits=True))
    return audit


def test_the_device_path_never_makes_the_host_wait() -> None:
    """Off the CPU (meta tensors take the device path; the first use of meta kernels costs
    a few seconds once per process) sampling with every feature reads no device value on
    the host and copies nothing back; the default path would (it sizes torch.topk by the
    largest k), which shows the check can fail."""
    for mode in ("greedy", "mixed"):
        audit = _audit(16, mode, None, "meta")
        assert audit.syncs == [] and audit.downloads == [], mode
        assert "aten.argmax" in audit.ops
    with pytest.raises(RuntimeError, match="meta"):
        _audit(16, "top_k", False, "meta")


def test_operations_do_not_grow_with_the_batch() -> None:
    """The fixed-shape path's operations at batch 1, 8 and 32 (every feature, CPU values):
    as many, and none that would wait; the default path's CPU-only reads are counted too,
    which shows the count can fail."""
    audits = {n: _audit(n, "all", True, "cpu") for n in (1, 8, 32)}
    launches = {n: len(a.launches) for n, a in audits.items()}
    assert len(set(launches.values())) == 1, launches
    assert all(a.syncs == [] for a in audits.values())
    assert _audit(8, "all", False, "cpu").syncs


@pytest.mark.parametrize("plan", [Plan.RANDOM, Plan.FILTERED])
def test_one_operation_sequence_whatever_each_rows_mode(plan: Plan) -> None:
    """With real values (CPU), rows of different modes at one batch size run the same
    operations under a plan; the default path's own sequence depends on the modes."""
    n = 4
    sequences, default = [], []
    for mode in ("greedy", "top_k_top_p", "mixed"):
        md = metadata(n, mode)
        rows = DenseRows(
            md.temperature if md.temperature is not None else torch.zeros(n),
            # int64 as in the post-layer buffers (a cast would be one more operation).
            md.top_k.long() if md.top_k is not None else torch.zeros(n, dtype=torch.int64),
            md.top_p if md.top_p is not None else torch.ones(n),
            md.min_p if md.min_p is not None else torch.zeros(n),
            torch.randint(0, 1 << 32, (n, 2)),
        )
        audit = OpAudit("cpu")
        with audit:
            sample_dense(_logits(n, 0), rows, plan, 64)
        sequences.append(audit.ops)
        assert audit.syncs == []
        audit = OpAudit("cpu")
        with audit:
            Sampler(fixed_shape=False)(_logits(n, 0), md)
        default.append(audit.ops)
    assert all(s == sequences[0] for s in sequences)
    assert any(s != default[0] for s in default)


def test_dense_bitmask_equals_the_bit_by_bit_reference() -> None:
    g = torch.Generator().manual_seed(3)
    vocab = 70
    bits = torch.randint(-(2**31), 2**31 - 1, (4, 3), generator=g).to(torch.int32)
    bits[1] = -1  # unconstrained
    logits = torch.randn(4, vocab, generator=g)
    want = logits.clone()
    for r in range(4):
        for t in range(vocab):
            if not (int(bits[r, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    apply_dense_bitmask(logits, bits)
    assert torch.equal(logits, want)
    assert torch.isfinite(logits[1]).all()
