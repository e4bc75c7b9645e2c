"""Tests for vllm/transformers_utils/eagle3_config.py and eagle3_weights.py: an EAGLE-3 head in
either layout is read and checked against its target, and every mismatch or damaged file is
a startup error naming the key or file (the speculators layout's numbers are checked against
the speculators package in tests/model_executor/models/test_eagle3_head.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.utils_eagle3 import write_eagle3_head
from tests.utils_models import build_checkpoint, hf_config
from vllm.transformers_utils.eagle3_config import read_eagle3_head

VOCAB = list(range(0, 512, 4))  # 128 draft tokens over the tiny models' 512


@pytest.fixture(scope="module")
def llama():
    return hf_config("llama")


@pytest.fixture
def head(tmp_path, llama) -> Path:
    return write_eagle3_head(tmp_path / "head", llama, aux_layer_ids=[0, 1, 2],
                             draft_vocab=VOCAB)


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path: Path, drop: str | None = None, **tensors: torch.Tensor) -> None:
    weights = load_file(str(path / "model.safetensors"))
    weights.pop(drop, None)
    weights.update(tensors)
    save_file(weights, str(path / "model.safetensors"))


def test_the_original_layout_is_read(head, llama) -> None:
    config = read_eagle3_head(head, llama)
    assert (config.layout, config.model_type, config.num_layers) == ("eagle3", "llama", 1)
    assert config.aux_layer_ids == (0, 1, 2) and not config.has_embedding
    assert config.tensors["layers.0.hidden_norm.weight"].name == "midlayer.hidden_norm.weight"
    assert config.draft_to_target().tolist() == VOCAB


def test_a_pickled_state_dict_is_read_like_safetensors(head, llama) -> None:
    weights = load_file(str(head / "model.safetensors"))
    (head / "model.safetensors").unlink()
    torch.save(weights, head / "pytorch_model.bin")
    config = read_eagle3_head(head, llama)
    assert config.tensors["fc.weight"].path.name == "pytorch_model.bin"
    assert config.draft_to_target().tolist() == VOCAB


def test_the_default_auxiliary_layers_are_upstreams(head, tmp_path) -> None:
    _edit_config(head, eagle_config={})
    deep = hf_config("llama")
    deep.num_hidden_layers = 12
    assert read_eagle3_head(head, deep).aux_layer_ids == (2, 6, 9)
    with pytest.raises(ValueError, match=r"no eagle_aux_hidden_state_layer_ids, and the default "
                                         r"\[2, 1, -1\] does not fit a target of 2 layers"):
        read_eagle3_head(head, hf_config("llama"))


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 32}, r"hidden_size is 32, the target's 64"),
    ({"vocab_size": 1024}, r"vocab_size is 1024, the target's 512"),
    ({"target_hidden_size": 128}, r"target_hidden_size is 128"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 1]}},
     r"eagle_aux_hidden_state_layer_ids \[0, 3, 1\] must lie in \[0, 2\]"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}},
     r"tensor 'fc.weight' in model.safetensors has shape \[64, 192\], expected \[64, 128\]"),
    ({"architectures": ["LlamaForCausalLM"]}, r"neither a speculators head"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"draft_vocab_size": 1000}, r"draft_vocab_size 1000 exceeds"),
])
def test_a_head_that_does_not_fit_is_refused_naming_the_key(head, llama, change,
                                                            message) -> None:
    _edit_config(head, **change)
    with pytest.raises(ValueError, match=r"--speculative-config.model: .*" + message):
        read_eagle3_head(head, llama)


def test_the_speculators_layout_names_its_verifier(tmp_path, llama) -> None:
    """A speculators config made for another architecture is refused (the reading of this
    layout's fields is checked with the package itself elsewhere)."""
    head = write_eagle3_head(tmp_path / "head", llama, aux_layer_ids=[0, 1, 2])
    top = json.loads((head / "config.json").read_text())
    layer = {k: top[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "rms_norm_eps",
                                 "vocab_size")}
    spec = {"speculators_model_type": "eagle3", "draft_vocab_size": 512,
            "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
            "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, **layer},
            "speculators_config": {"algorithm": "eagle3",
                                   "verifier": {"architectures": ["Qwen3ForCausalLM"]}}}
    (head / "config.json").write_text(json.dumps(spec))
    weights = load_file(str(head / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in weights.items()},
              str(head / "model.safetensors"))
    with pytest.raises(ValueError, match=r"verifier.architectures \['Qwen3ForCausalLM'\] does "
                                         r"not include the target's \['LlamaForCausalLM'\]"):
        read_eagle3_head(head, llama)
    spec["speculators_config"]["verifier"]["architectures"] = ["LlamaForCausalLM"]
    (head / "config.json").write_text(json.dumps(spec))
    assert read_eagle3_head(head, llama).layout == "speculators"
    spec["speculators_model_type"] = "dflash"
    (head / "config.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"speculators_model_type 'dflash' is not supported"):
        read_eagle3_head(head, llama)


@pytest.mark.parametrize("edit, message", [
    (dict(drop="d2t"), r"drafts over 128 of the target's 512 tokens but its weights lack 'd2t'"),
    (dict(drop="norm.weight"), r"lack tensor 'norm.weight'"),
    (dict(extra=torch.zeros(3)), r"tensor 'extra' in model.safetensors has no place"),
    (dict(**{"lm_head.weight": torch.zeros(100, 64)}),
     r"'lm_head.weight' in model.safetensors has shape \[100, 64\], expected \[128, 64\]"),
    (dict(d2t=torch.full((128,), 600)), r"d2t maps draft id 0 to 600, outside"),
])
def test_a_head_with_wrong_tensors_is_refused_naming_them(head, llama, edit, message) -> None:
    _edit_tensors(head, **edit)
    with pytest.raises(ValueError, match=message):
        read_eagle3_head(head, llama)


def test_damaged_or_missing_files_are_named(head, llama, tmp_path) -> None:
    data = (head / "model.safetensors").read_bytes()
    (head / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot read .*model.safetensors"):
        read_eagle3_head(head, llama)
    (head / "model.safetensors").unlink()
    (head / "pytorch_model.bin").write_bytes(b"not a zip archive")
    with pytest.raises(ValueError, match=r"cannot read pytorch_model.bin"):
        read_eagle3_head(head, llama)
    (head / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match=r"no \*.safetensors or pytorch_model.bin weights"):
        read_eagle3_head(head, llama)
    (head / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"malformed config.json"):
        read_eagle3_head(head, llama)
    with pytest.raises(ValueError, match=r"is not a directory"):
        read_eagle3_head(tmp_path / "nowhere", llama)


def test_the_engine_checks_the_head_at_startup(tmp_path) -> None:
    """Through EngineArgs: eagle3 reads and checks the head before any process starts;
    'eagle' and the layouts the head cannot run beside are refused with the reason."""
    from vllm.engine.arg_utils import EngineArgs

    target = tmp_path / "target"
    hf = build_checkpoint("llama", target, seed=1)
    head = write_eagle3_head(tmp_path / "head", hf.config, aux_layer_ids=[0, 1, 2])
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    config = EngineArgs(model=str(target), speculative_config=spec).create_engine_config()
    assert config.speculative_config.draft_head.aux_layer_ids == (0, 1, 2)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 is not supported"):
        EngineArgs(model=str(target), speculative_config=spec,
                   tensor_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match=r"'eagle' \(EAGLE-1/2 heads.*use an EAGLE-3 head"):
        EngineArgs(model=str(target), speculative_config={**spec, "method": "eagle"}
                   ).create_engine_config()
    with pytest.raises(ValueError, match=r"--speculative-config.model: required with method "
                                         r"'draft_model' or 'eagle3'"):
        EngineArgs(model=str(target), speculative_config={"method": "eagle3"}
                   ).create_engine_config()
    _edit_config(head, hidden_size=32)
    with pytest.raises(ValueError, match=r"hidden_size is 32, the target's 64"):
        EngineArgs(model=str(target), speculative_config=spec).create_engine_config()
