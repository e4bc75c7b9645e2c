"""Pipeline-parallel model stages (tp=1, one process): split layers, bit-identical logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model_executor.models.utils_parallel import (
    build_tiny,
    load,
    pp_context,
    run_workload,
)
from vllm.model_executor.model_loader.weight_utils import iterate_safetensors

# name -> (architecture, config overrides). Three layers, so pp=2 splits them 2 + 1.
CASES = {
    "qwen3_tied": ("qwen3", {}),
    "qwen2": ("qwen2", {}),
    "llama": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3_rope_tied": ("llama3_rope", {}),
    # Mixture of experts: renamed checkpoint modules (block_sparse_moe) split by stage.
    "mixtral": ("mixtral", {}),
    # A dense middle layer between sparse ones.
    "qwen3_moe": ("qwen3_moe", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        case: build_tiny(arch, tmp_path_factory.mktemp(case), seed=i, num_hidden_layers=3,
                         **overrides)
        for i, (case, (arch, overrides)) in enumerate(CASES.items())
    }


def _stages(path: Path, pp: int, **kwargs) -> list[torch.nn.Module]:
    return [load(path, pp_context(pp, r), **kwargs) for r in range(pp)]


@pytest.mark.parametrize("case", CASES)
def test_pipeline_stages_match_whole_model_bit_for_bit(case: str, checkpoints) -> None:
    path = checkpoints[case]
    whole = load(path)
    want = run_workload([whole])
    assert want.shape[1] == whole.vocab_size and want.std() > 0.5
    for pp in (2, 3):
        stages = _stages(path, pp)
        assert [m.num_layers for m in stages] == ([2, 1] if pp == 2 else [1, 1, 1])
        assert all(m.num_kv_heads == whole.num_kv_heads for m in stages)
        assert all(m.vocab_size == whole.vocab_size for m in stages)
        assert torch.equal(run_workload(stages), want), f"pp={pp}"


@pytest.mark.parametrize("case", ["qwen3_tied", "llama"])
def test_stage_parameters_partition_the_model(case: str, checkpoints) -> None:
    path = checkpoints[case]
    whole = load(path).state_dict()
    stages = [m.state_dict() for m in _stages(path, 2)]
    names = [set(s) for s in stages]
    assert names[0].isdisjoint(names[1])
    assert names[0] | names[1] == set(whole)
    assert "model.layers.1.mlp.down_proj.weight" in names[0]
    assert "model.layers.2.mlp.down_proj.weight" in names[1]
    assert {"model.embed_tokens.weight"} <= names[0] and "lm_head.weight" in names[1]
    assert "model.norm.weight" in names[1]
    for state in stages:
        assert all(torch.equal(value, whole[name]) for name, value in state.items())


@pytest.mark.parametrize("case", ["qwen3_tied", "qwen2"])
def test_dummy_weights_per_stage_equal_whole_model(case: str, checkpoints) -> None:
    path = checkpoints[case]
    whole = load(path, load_format="dummy", seed=5).state_dict()
    for pp in (2, 3):
        for model in _stages(path, pp, load_format="dummy", seed=5):
            for name, value in model.state_dict().items():
                assert torch.equal(value, whole[name]), name
    # Tied: the last stage's head (no embedding there) takes the embedding's values.
    if case == "qwen3_tied":
        assert torch.equal(whole["lm_head.weight"], whole["model.embed_tokens.weight"])


def test_stage_misuse_raises(checkpoints) -> None:
    first, last = _stages(checkpoints["qwen2"], 2)
    assert first.lm_head is None and last.model.embed_tokens is None
    with pytest.raises(RuntimeError, match="last pipeline stage"):
        first.compute_logits(torch.zeros(1, first.hidden_size))
    ids = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="intermediate"):
        last(ids, ids, [torch.zeros(0)], None)
    with pytest.raises(ValueError, match="pipeline-parallel-size"):
        load(checkpoints["qwen2"], pp_context(4, 0))


def _weights(path: Path, drop: str | None = None, add: dict | None = None):
    for name, tensor in iterate_safetensors(path):
        if name != drop:
            yield name, tensor
    yield from (add or {}).items()


def test_loading_checks_are_per_stage(checkpoints) -> None:
    path = checkpoints["llama"]
    first, last = _stages(path, 2)
    # A tensor of layer 2 is missing: only the stage that runs layer 2 needs it.
    name = "model.layers.2.self_attn.k_proj.weight"
    first.load_weights(_weights(path, drop=name))
    with pytest.raises(ValueError, match=name):
        last.load_weights(_weights(path, drop=name))
    # A tensor that belongs to no stage is an error on every stage.
    for model in (first, last):
        for bad in ("model.extra.weight", "model.layers.3.mlp.up_proj.weight"):
            with pytest.raises(ValueError, match=bad):
                model.load_weights(_weights(path, add={bad: torch.zeros(2)}))


def test_plain_tensors_load_like_lazy_handles(checkpoints) -> None:
    path = checkpoints["qwen2"]
    lazy = load(path)
    plain = load(path, load_format="dummy")
    plain.load_weights((name, t.read().clone()) for name, t in iterate_safetensors(path))
    want = lazy.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in plain.state_dict().items())


def test_lazy_handle_reads_ranges(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    full = torch.arange(24.0).reshape(4, 6)
    save_file({"w": full, "b": torch.arange(5.0)}, tmp_path / "model.safetensors")
    handles = dict(iterate_safetensors(tmp_path))
    w, b = handles["w"], handles["b"]
    assert w.shape == (4, 6) and b.shape == (5,)
    assert torch.equal(w.read_range(0, 1, 2), full[1:3])
    assert torch.equal(w.read_range(1, 2, 3), full[:, 2:5])
    assert torch.equal(b.read_range(0, 4, 1), torch.tensor([4.0]))
    assert torch.equal(w.read(), full)
    with pytest.raises(ValueError, match="outside"):
        w.read_range(0, 3, 2)
    with pytest.raises(ValueError, match="dim 2"):
        w.read_range(2, 0, 1)
