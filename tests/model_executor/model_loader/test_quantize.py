"""Quantized checkpoints through the loader, against transformers on the dequantized model.

Oracle: each format's tiny checkpoint is written by the real library (compressed-tensors)
or by the format's packing rules (GPTQ, AWQ; see tests/utils_quant.py), and transformers
runs the same model with the dequantized weights. On the CPU the engine dequantizes in
float32 exactly as that oracle's weights were made, so the tolerance is the dense one:
logits within 1e-4. Quantization must also matter (the oracle is farther than that from
the full-precision model), the packed weights must stay packed (loaded weight memory
within 10% of the packed checkpoint), and broken or mismatched checkpoints fail with an
error naming the key.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_executor.models.test_models import PagedRunner, _sequences
from tests.utils_quant import (
    checkpoint_bytes,
    ct_checkpoint,
    edit_config,
    fp8_rows_oracle,
    packed_checkpoint,
    tiny_hf,
)
from vllm.config import ModelConfig
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.model_loader.weight_utils import weight_bytes

TOLERANCE = 1e-4
# name -> (architecture, seed, how the checkpoint is made, --quantization)
FORMATS = {
    "ct_fp8_channel": ("qwen3", 40, lambda p: ct_checkpoint("qwen3", p, "fp8_channel", 40), None),
    "ct_fp8_tensor": ("llama", 41, lambda p: ct_checkpoint("llama", p, "fp8_tensor", 41), None),
    "ct_w4a16": ("qwen3", 42, lambda p: ct_checkpoint("qwen3", p, "w4a16", 42),
                 "compressed-tensors"),
    "gptq": ("llama", 43, lambda p: packed_checkpoint("llama", p, "gptq", 43), "gptq"),
    "gptq_act_order": ("qwen3", 44, lambda p: packed_checkpoint(
        "qwen3", p, "gptq", 44, act_order=True, sym=False), None),
    "awq": ("qwen2", 45, lambda p: packed_checkpoint("qwen2", p, "awq", 45), "awq"),
    "fp8_online": ("llama", 46, lambda p: fp8_rows_oracle("llama", p, 46), "fp8"),
    # Attention and the dense middle layer in FP8; experts and routers stay float32.
    "fp8_online_moe": ("qwen3_moe", 49, lambda p: fp8_rows_oracle("qwen3_moe", p, 49), "fp8"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """format -> (checkpoint dir, transformers model with the dequantized weights)."""
    out = {}
    for name, (_, _, make, _) in FORMATS.items():
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, make(path))
    return out


def _config(path: Path, **kwargs) -> ModelConfig:
    return ModelConfig(model=str(path), dtype="float32", attention_backend="torch", **kwargs)


def _load(name: str, path: Path) -> torch.nn.Module:
    return get_model(_config(path, quantization=FORMATS[name][3]))


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("name", list(FORMATS))
def test_logits_equal_the_dequantized_model(name: str, checkpoints) -> None:
    path, oracle = checkpoints[name]
    arch, seed = FORMATS[name][:2]
    model = _load(name, path)
    seqs = _sequences([9, 4, 13], seed=seed)
    runner = PagedRunner(model, seqs, block_size=4, seed=seed)
    prefill = runner.step({0: 6, 1: 4, 2: 13})
    decode = runner.step({0: 3})
    full = tiny_hf(arch, seed)
    for i, got in prefill.items():
        want = _hf_logits(oracle, seqs[i])
        assert (got - want[: len(got)]).abs().max().item() < TOLERANCE
        # The quantization error is visible, so this test tells packed from dense weights.
        assert (want - _hf_logits(full, seqs[i])).abs().max().item() > 10 * TOLERANCE
    want = _hf_logits(oracle, seqs[0])[6:9]
    assert (decode[0] - want).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("name", [n for n in FORMATS if not n.startswith("fp8_online")])
def test_weights_stay_packed(name: str, checkpoints) -> None:
    path = checkpoints[name][0]
    model = _load(name, path)
    packed = checkpoint_bytes(path)
    assert abs(weight_bytes(model) - packed) <= 0.1 * packed
    qkv = model.model.layers[0].self_attn.qkv_proj
    kinds = {p.dtype for p in qkv.parameters()}
    assert kinds & {torch.int32, torch.float8_e4m3fn}
    assert not hasattr(qkv, "weight") or qkv.weight.dtype == torch.float8_e4m3fn


def test_fp8_at_load_halves_the_projections_of_float32(checkpoints) -> None:
    path = checkpoints["fp8_online"][0]
    dense = get_model(_config(path))
    model = _load("fp8_online", path)
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.shape == (layer.weight.shape[0],)
    # Expected: every projection at one byte per weight plus a float32 scale per row.
    saved = 0
    for module in dense.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "materialize") and weight is not None:
            saved += weight.numel() * 3 - weight.shape[0] * 4
    expected = weight_bytes(dense) - saved
    assert abs(weight_bytes(model) - expected) <= 0.1 * expected


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_quantization_flag_must_agree_with_the_checkpoint(checkpoints) -> None:
    with pytest.raises(ValueError, match=r"--quantization awq disagrees with .*quant_method "
                                         r"'gptq' \(config\.json\)"):
        _config(checkpoints["gptq"][0], quantization="awq")
    with pytest.raises(ValueError, match=r"--quantization gptq: .*no quantization_config"):
        _config(checkpoints["fp8_online"][0], quantization="gptq")
    with pytest.raises(ValueError, match=r"--quantization: 'int3' is not one of"):
        _config(checkpoints["fp8_online"][0], quantization="int3")
    # Upstream's Marlin names select the same format.
    assert _config(checkpoints["gptq"][0], quantization="gptq_marlin").quant_config.name == "gptq"


def test_missing_scale_tensor_is_named(checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints["ct_fp8_channel"][0], tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale"))
    with pytest.raises(ValueError, match=r"missing tensor "
                                         r"'model\.layers\.1\.self_attn\.k_proj\.weight_scale'"):
        get_model(_config(path))


@pytest.mark.parametrize("name,key", [("ct_w4a16", "weight_scale"), ("gptq", "(scales|qzeros)"),
                                      ("awq", "(scales|qzeros)")])
def test_wrong_group_size_is_named(name: str, key: str, checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints[name][0], tmp_path / "ckpt")

    def halve(config: dict) -> None:
        quant = config["quantization_config"]
        if name == "ct_w4a16":
            quant["config_groups"]["group_0"]["weights"]["group_size"] = 16
        else:
            quant["group_size"] = 16

    edit_config(path, halve)
    with pytest.raises(ValueError, match=rf"'model\.layers\.0\.[a-z_.]+\.{key}': shape .* "
                                         r"\(group_size 16 from quantization_config\)"):
        get_model(_config(path))


@pytest.mark.parametrize("name,key,match", [
    ("ct_fp8_channel", "model.layers.1.mlp.up_proj.weight", "not the FP8"),
    ("awq", "model.layers.0.self_attn.q_proj.qweight", "not the packed integers"),
])
def test_full_precision_tensor_in_place_of_packed_is_named(name: str, key: str, match: str,
                                                            checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints[name][0], tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t.__setitem__(key, t[key].float()))
    with pytest.raises(ValueError, match=rf"'{re.escape(key)}': dtype torch.float32 is {match}"):
        get_model(_config(path))


def test_corrupt_group_index_is_named(checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints["gptq_act_order"][0], tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t["model.layers.0.mlp.down_proj.g_idx"].fill_(99))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.g_idx': g_idx "
                                         r"has group indices outside"):
        get_model(_config(path))


@pytest.mark.parametrize("edit,match", [
    (lambda q: q.__setitem__("bits", 8), r"quantization_config\.bits: 8 is not supported"),
    (lambda q: q.__setitem__("quant_method", "bitsandbytes"),
     r"quant_method: 'bitsandbytes' \(config\.json\) is not supported"),
    (lambda q: q.__setitem__("checkpoint_format", "marlin"), r"checkpoint_format: 'marlin'"),
])
def test_unsupported_gptq_configs_are_named(edit, match, checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints["gptq"][0], tmp_path / "ckpt")
    edit_config(path, lambda c: edit(c["quantization_config"]))
    with pytest.raises(ValueError, match=match):
        _config(path)


def test_static_activation_scales_are_refused(checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints["ct_fp8_channel"][0], tmp_path / "ckpt")
    edit_config(path, lambda c: c["quantization_config"]["config_groups"]["group_0"][
        "input_activations"].__setitem__("dynamic", False))
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.input_activations: static"):
        _config(path)


def test_ignore_list_keeps_layers_dense(tmp_path: Path) -> None:
    # The MLP's projections are ignored (by exact name and by regex): dense in the engine.
    oracle = ct_checkpoint("qwen3", tmp_path, "fp8_channel", 47,
                           ignore=["model.layers.0.mlp.down_proj", "re:.*up_proj$",
                                   "re:.*gate_proj$"])
    model = get_model(_config(tmp_path))
    layers = model.model.layers
    assert layers[0].mlp.down_proj.quant_method is None
    assert layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    assert layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    seqs = _sequences([7], seed=1)
    got = PagedRunner(model, seqs, block_size=4, seed=1).step({0: 7})[0]
    assert (got - _hf_logits(oracle, seqs[0])).abs().max().item() < TOLERANCE


def test_fused_parts_quantized_differently_are_refused(tmp_path: Path) -> None:
    ct_checkpoint("qwen3", tmp_path, "fp8_channel", 48, ignore=["re:.*k_proj$"])
    with pytest.raises(ValueError, match=r"q_proj, .*k_proj, .*v_proj: .*quantized differently"):
        get_model(_config(tmp_path))


def test_dummy_weights_cannot_be_quantized(checkpoints) -> None:
    with pytest.raises(ValueError, match="--load-format dummy cannot be combined"):
        get_model(_config(checkpoints["gptq"][0], load_format="dummy"))


def test_fp8_experts_equal_the_dequantized_model(tmp_path: Path) -> None:
    from tests.utils_quant import fp8_moe_checkpoint

    oracle = fp8_moe_checkpoint(tmp_path / "fp8", 50, tmp_path / "oracle")
    model = get_model(_config(tmp_path / "fp8"))
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert experts.w2_weight_scale.shape == (8, 64)
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # ignored router
    seqs = _sequences([11, 5], seed=2)
    got = PagedRunner(model, seqs, block_size=4, seed=2).step({0: 11, 1: 5})
    full = tiny_hf("qwen3_moe", 50)
    for i, seq in enumerate(seqs):
        want = _hf_logits(oracle, seq)
        assert (got[i] - want).abs().max().item() < TOLERANCE
        assert (want - _hf_logits(full, seq)).abs().max().item() > 10 * TOLERANCE
    # Packed: the FP8 experts take about a quarter of their float32 bytes.
    assert abs(weight_bytes(model) - checkpoint_bytes(tmp_path / "fp8")) <= 0.1 * \
        checkpoint_bytes(tmp_path / "fp8")


def _moe_with(tmp_path: Path, extra: dict[str, torch.Tensor], quant: dict) -> Path:
    from tests.utils_models import build_checkpoint

    build_checkpoint("qwen3_moe", tmp_path, seed=3)
    _edit_tensors(tmp_path, lambda t: t.update(extra))
    edit_config(tmp_path, lambda c: c.__setitem__("quantization_config", quant))
    return tmp_path


def test_4bit_and_gptq_experts_are_refused(tmp_path: Path) -> None:
    w4a16 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["re:.*experts.*"], "weights": {
                 "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}}}
    path = _moe_with(tmp_path / "ct", {}, w4a16)
    with pytest.raises(ValueError, match=r"experts: only FP8 mixture-of-experts experts are "
                                         r"supported, not 4-bit ones"):
        get_model(_config(path))
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
    qweight = {"model.layers.0.mlp.experts.0.gate_proj.qweight": torch.zeros(8, 32,
                                                                             dtype=torch.int32)}
    path = _moe_with(tmp_path / "gptq", qweight, gptq)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.qweight'.*quantized "
                                         r"mixture-of-experts experts are not supported for gptq"):
        get_model(_config(path))


@pytest.mark.parametrize("name", ["gptq_act_order", "ct_fp8_tensor"])
def test_pipeline_stages_match_the_whole_model(name: str, checkpoints) -> None:
    from tests.model_executor.models.utils_parallel import pp_context, run_workload

    path, quantization = checkpoints[name][0], FORMATS[name][3]
    whole = run_workload([_load(name, path)])
    stages = [get_model(_config(path, quantization=quantization), pp_context(2, r))
              for r in range(2)]
    assert [m.num_layers for m in stages] == [1, 1]
    assert torch.equal(run_workload(stages), whole)
