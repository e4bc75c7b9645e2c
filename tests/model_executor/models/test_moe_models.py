"""Mixture-of-experts families against Hugging Face transformers.

Oracle: random tiny Qwen3-MoE (one dense layer among sparse ones, renormalised top-k),
Mixtral (renormalised, its own checkpoint names) and Qwen2-MoE (a dense first layer, raw
top-k weights, a gated shared expert) checkpoints run through the whole offline engine give
transformers' greedy tokens and per-step logits. Also: what the loader builds and rejects,
and dummy weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.entrypoints.test_llm_hf_equivalence import (
    GREEDY,
    _assert_pool_full,
    _check_against_hf,
    _engine,
    _prompts,
)
from tests.utils_models import build_checkpoint, capture_logits
from vllm.config import ModelConfig
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.model_executor.models.llama import LlamaMLP

ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe"]
# Which decoder layers of each tiny config are sparse (see tests/utils_models.py).
SPARSE_LAYERS = {"qwen3_moe": [True, False, True], "mixtral": [True, True],
                 "qwen2_moe": [False, True]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """name -> (checkpoint dir, Hugging Face model with the same weights)."""
    return {
        name: (path := tmp_path_factory.mktemp(name), build_checkpoint(name, path, seed=20 + i))
        for i, name in enumerate(ARCHS)
    }


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    return str(build_demo_model("demo-tiny"))


def _config(path: Path, **kwargs) -> ModelConfig:
    return ModelConfig(model=str(path), dtype="float32", attention_backend="torch", **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_matches_hf(arch: str, checkpoints, tokenizer_dir: str) -> None:
    path, hf = checkpoints[arch]
    # 16 tokens per step splits the longer prompts into chunks, so decode and prefill
    # tokens of different requests share MoE layers.
    llm = _engine(path, tokenizer_dir, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    captured = capture_logits(llm)
    prompts = _prompts(seed=4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _check_against_hf(hf, prompts, outputs, captured)
    _assert_pool_full(llm)
    llm.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_follow_the_config(arch: str, checkpoints) -> None:
    model = get_model(_config(checkpoints[arch][0]))
    sparse = [isinstance(layer.mlp.experts, FusedMoE) if hasattr(layer.mlp, "experts")
              else False for layer in model.model.layers]
    assert sparse == SPARSE_LAYERS[arch]
    for layer, is_sparse in zip(model.model.layers, sparse):
        assert is_sparse or isinstance(layer.mlp, LlamaMLP)
    renormalize = {"qwen3_moe": True, "mixtral": True, "qwen2_moe": False}[arch]
    moe = next(layer.mlp for layer, s in zip(model.model.layers, sparse) if s)
    assert moe.experts.renormalize is renormalize
    assert (moe.shared_expert is not None) is (arch == "qwen2_moe")
    # The torch MoE path syncs with the host, so the runner must not capture CUDA graphs.
    assert model.supports_cuda_graphs is False


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_dummy_weights_fill_the_experts(arch: str, checkpoints) -> None:
    a = get_model(_config(checkpoints[arch][0], load_format="dummy", seed=5))
    b = get_model(_config(checkpoints[arch][0], load_format="dummy", seed=5))
    w13 = a.model.layers[0].mlp.experts.w13_weight
    assert torch.isfinite(w13).all() and w13.std() > 0.01
    assert torch.equal(w13, b.model.layers[0].mlp.experts.w13_weight)


def test_missing_expert_tensor_is_named(checkpoints, tmp_path: Path) -> None:
    source = checkpoints["mixtral"][0]
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.3\.w3\.weight"):
        get_model(_config(tmp_path))


def test_missing_moe_field_is_named(checkpoints, tmp_path: Path) -> None:
    import json

    source = checkpoints["qwen3_moe"][0]
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_experts_per_tok"] = 9  # more than the 8 experts
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        get_model(_config(tmp_path))


def test_triton_backend_matches_hf(checkpoints, tokenizer_dir: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The same oracle with the Triton grouped GEMM (interpreted on a CPU)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("VLLM_MOE_BACKEND", "triton")
    path, hf = checkpoints["qwen3_moe"]
    llm = _engine(path, tokenizer_dir, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    model = llm.llm_engine.engine_core.model_executor.worker.model_runner.model
    assert model.model.layers[0].mlp.experts.backend == "triton"
    captured = capture_logits(llm)
    prompts = _prompts(seed=5)[:3]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _check_against_hf(hf, prompts, outputs, captured)
    llm.shutdown()
