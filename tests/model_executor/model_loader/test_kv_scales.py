"""Tests vllm/model_executor/model_loader/kv_scales.py: per-layer FP8 KV-cache scales read
from a checkpoint into the attention layers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.utils_models import build_checkpoint
from vllm.attention.backends.torch_backend import TorchAttentionBackend
from vllm.config import ModelConfig
from vllm.model_executor.model_loader.kv_scales import KVScaleLoader, kv_scale_of
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.model_loader.weight_utils import CheckpointTensor


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny two-layer Llama checkpoint without scales."""
    path = tmp_path_factory.mktemp("llama")
    build_checkpoint("llama", path, seed=2)
    return path


def with_tensors(plain: Path, dest: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of `plain` whose safetensors file also holds `extra`."""
    shutil.copytree(plain, dest)
    file = dest / "model.safetensors"
    tensors = load_file(file)
    tensors.update(extra)
    save_file(tensors, file, metadata={"format": "pt"})
    return dest


def scales_of(path: Path) -> list[tuple[float, float]]:
    model = get_model(ModelConfig(model=str(path), dtype="float32", attention_backend="torch"))
    return [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale)
            for layer in model.model.layers]


def test_names_of_every_spelling() -> None:
    assert kv_scale_of("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_of("model.layers.0.self_attn.v_scale") == (0, "v")
    assert kv_scale_of("model.layers.12.self_attn.kv_scale") == (12, "kv")
    assert kv_scale_of("model.layers.1.self_attn.k_proj.output_scale") == (1, "k")
    assert kv_scale_of("model.layers.1.self_attn.v_proj.output_scale") == (1, "v")
    assert kv_scale_of("model.layers.1.self_attn.q_proj.weight") is None
    assert kv_scale_of("model.layers.1.self_attn.k_proj.weight_scale") is None


def test_scalar_scales_reach_every_layer(plain: Path, tmp_path: Path) -> None:
    # 0-d tensors, as llm-compressor writes them (a safetensors slice of a 0-d tensor cannot
    # be read with [:]), and a 1-element one.
    path = with_tensors(plain, tmp_path / "ckpt", {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.k_scale": torch.tensor(2.0, dtype=torch.bfloat16),
        "model.layers.1.self_attn.v_scale": torch.tensor(4.0),
    })
    assert scales_of(path) == [(0.5, 0.25), (2.0, 4.0)]


def test_without_scales_every_layer_keeps_one(plain: Path) -> None:
    assert scales_of(plain) == [(1.0, 1.0), (1.0, 1.0)]


def test_one_kv_scale_serves_keys_and_values(plain: Path, tmp_path: Path) -> None:
    path = with_tensors(plain, tmp_path / "ckpt", {
        f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.125 * (i + 1)) for i in (0, 1)
    })
    assert scales_of(path) == [(0.125, 0.125), (0.25, 0.25)]


@pytest.mark.parametrize(("extra", "message"), [
    ({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)},
     "missing tensor 'model.layers.1.self_attn.k_scale'"),
    ({"model.layers.0.self_attn.v_scale": torch.tensor(-1.0)},
     "'model.layers.0.self_attn.v_scale'.*finite and positive"),
    ({"model.layers.1.self_attn.k_scale": torch.tensor([0.5, 0.5])},
     "'model.layers.1.self_attn.k_scale'.*one value"),
    ({"model.layers.7.self_attn.k_scale": torch.tensor(0.5)},
     "'model.layers.7.self_attn.k_scale'.*2 layers"),
], ids=["partial", "negative", "per_channel", "no_such_layer"])
def test_a_bad_scale_is_an_error_naming_the_tensor(
    plain: Path, tmp_path: Path, extra: dict[str, torch.Tensor], message: str
) -> None:
    path = with_tensors(plain, tmp_path / "ckpt", extra)
    with pytest.raises(ValueError, match=message):
        scales_of(path)


def test_scales_of_another_pipeline_stage_are_skipped() -> None:
    backend = TorchAttentionBackend(2, 4, 2, 0.5)
    loader = KVScaleLoader({1: backend}, num_layers=2)
    assert loader.take("model.layers.0.self_attn.k_scale", CheckpointTensor(torch.tensor(9.0)))
    assert loader.take("model.layers.1.self_attn.k_scale", CheckpointTensor(torch.tensor(3.0)))
    assert not loader.take("model.layers.1.mlp.down_proj.weight", CheckpointTensor(torch.ones(1)))
    assert loader.finish()
    assert (backend.k_scale, backend.v_scale) == (3.0, 1.0)
