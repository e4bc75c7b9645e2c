"""Tensor-parallel models in real processes: two gloo ranks against the tp=1 model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.model_executor.models.utils_parallel import build_tiny, load, run_workload, tp_worker

# One spawn of two ranks runs every case (about 15 s of process start-up and checkpoints).
pytestmark = pytest.mark.slow

TP = 2
# tag -> (architecture, config overrides, extra ModelConfig kwargs, local KV heads).
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], int]] = {
    # KV heads split (2 over 2 ranks), q/k norm, tied embeddings, head_dim * heads != hidden.
    "qwen3": ("qwen3", {}, {}, 1),
    # One KV head replicated on both ranks; an odd vocabulary pads the last vocab shard;
    # biases on every projection (the row-parallel bias must be added once).
    "llama_mqa": (
        "llama",
        {"num_key_value_heads": 1, "vocab_size": 509, "attention_bias": True, "mlp_bias": True},
        {},
        1,
    ),
    # qkv bias, tied embeddings over a padded vocabulary.
    "qwen2_tied": ("qwen2", {"vocab_size": 511, "tie_word_embeddings": True}, {}, 1),
    # Dummy weights: shards differ from tp=1, but the ranks must still agree.
    "dummy": ("qwen2", {}, {"load_format": "dummy", "seed": 3}, 1),
    # Experts' intermediate dimension split over the ranks; a dense layer among sparse ones.
    "qwen3_moe": ("qwen3_moe", {}, {}, 1),
    # Routed experts and a shared expert, each all-reduced.
    "qwen2_moe": ("qwen2_moe", {}, {}, 1),
    # Quantized checkpoints (see QUANTIZED): packed tensors sliced by rows or columns,
    # GPTQ's scattered groups kept whole on the row-parallel ranks.
    "gptq_act_order": ("qwen3", {}, {}, 1),
    "ct_w4a16": ("qwen3", {}, {}, 1),
}


def _quantized(tag: str, path: Path, seed: int) -> Path:
    from tests.utils_quant import ct_checkpoint, packed_checkpoint

    path.mkdir(parents=True)
    if tag == "gptq_act_order":
        packed_checkpoint("qwen3", path, "gptq", seed, act_order=True, sym=False)
    else:
        ct_checkpoint("qwen3", path, "w4a16", seed)
    return path


# Checkpoints written by a quantization format rather than build_tiny.
QUANTIZED = ("gptq_act_order", "ct_w4a16")
# Per-expert intermediate size of the MoE cases (see tests/utils_models.py).
MOE_INTERMEDIATE = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_ckpt")
    return {
        tag: _quantized(tag, root / tag, 10 + i) if tag in QUANTIZED
        else build_tiny(arch, root / tag, seed=10 + i, **overrides)
        for i, (tag, (arch, overrides, _, _)) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def tp_results(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """tag -> what each rank saved (logits and local sizes)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < TP:
        pytest.skip(f"needs {TP} GPUs when CUDA is present")
    root = tmp_path_factory.mktemp("tp_run")
    jobs = [(tag, str(checkpoints[tag]), kwargs) for tag, (_, _, kwargs, _) in CASES.items()]
    mp.spawn(tp_worker, args=(TP, str(root / "init"), jobs, str(root)), nprocs=TP, join=True)
    return {tag: [torch.load(root / f"{tag}.{r}.pt") for r in range(TP)] for tag in CASES}


@pytest.mark.parametrize("tag", CASES)
def test_ranks_hold_shards_and_agree_exactly(tag: str, tp_results) -> None:
    arch, overrides, _, kv_heads = CASES[tag]
    vocab = overrides.get("vocab_size", 512)
    head_dim = 32 if arch in ("qwen3", "qwen3_moe") else 16
    first, *others = tp_results[tag]
    # 4 query heads split 2 + 2; the KV heads split or replicate; ceil(vocab / 2) rows each.
    assert first["num_kv_heads"] == kv_heads
    assert first["qkv_rows"] == (4 // TP + 2 * kv_heads) * head_dim
    assert first["vocab_rows"] == -(-vocab // TP)
    assert first["logits"].shape[1] == vocab
    assert torch.isfinite(first["logits"]).all()
    # Each rank holds its half of every expert's gate and up rows.
    want_w13 = 2 * MOE_INTERMEDIATE // TP if arch.endswith("_moe") else None
    assert first["w13_rows"] == want_w13
    for other in others:
        assert torch.equal(first["logits"], other["logits"])


@pytest.mark.parametrize("tag", [t for t in CASES if t != "dummy"])
def test_tensor_parallel_matches_single_rank(tag: str, tp_results, checkpoints) -> None:
    want = run_workload([load(checkpoints[tag], **CASES[tag][2])])
    got = tp_results[tag][0]["logits"]
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert want.std() > 0.5  # far from trivial logits
    assert (got - want).abs().max().item() < 1e-4
