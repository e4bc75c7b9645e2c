"""--generation-config: a model's generation_config.json gives the sampling defaults of
requests that leave a field unset (ModelConfig.sampling_defaults), in the server and in
`LLM.get_default_sampling_params`; a request's own value always wins."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm.config import ModelConfig
from vllm.entrypoints.openai.protocol import CompletionRequest
from vllm.entrypoints.openai.serving_engine import OpenAIServing
from vllm.model_executor.model_loader.demo_model import build_demo_model


def _model_with(tmp_path: Path, generation: dict) -> Path:
    """demo-tiny's files, linked, with generation_config.json replaced."""
    demo = build_demo_model("demo-tiny")
    model = tmp_path / "model"
    model.mkdir()
    for f in demo.iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    (model / "generation_config.json").write_text(json.dumps(generation))
    return model


SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.8, "top_k": 20,
            "repetition_penalty": 1.1, "eos_token_id": 151645, "max_new_tokens": 9}


def test_sampling_fields_of_the_generation_config(tmp_path: Path) -> None:
    model = _model_with(tmp_path, SAMPLING)
    assert ModelConfig(str(model)).sampling_defaults == {
        "temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}
    assert ModelConfig(str(model), generation_config="vllm").sampling_defaults == {}


def test_do_sample_false_means_greedy_whatever_temperature_says(tmp_path: Path) -> None:
    model = _model_with(tmp_path, {**SAMPLING, "do_sample": False})
    assert ModelConfig(str(model)).sampling_defaults == {"repetition_penalty": 1.1}


def test_another_directory_and_a_missing_one(tmp_path: Path) -> None:
    other = _model_with(tmp_path, {"temperature": 0.3})
    config = ModelConfig("demo-tiny", generation_config=str(other))
    assert config.sampling_defaults == {"temperature": 0.3}
    with pytest.raises(ValueError, match="--generation-config"):
        ModelConfig("demo-tiny", generation_config=str(tmp_path / "nowhere"))


def _serving(defaults: dict) -> OpenAIServing:
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.engine = SimpleNamespace(model_config=SimpleNamespace(sampling_defaults=defaults))
    return serving


def test_server_fills_only_what_the_request_leaves_unset() -> None:
    serving = _serving({"temperature": 0.6, "top_k": 20})
    params = serving.sampling_params(CompletionRequest(prompt="x"), 8, None)
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 20, 1.0)
    params = serving.sampling_params(CompletionRequest(prompt="x", temperature=0.0, top_k=5),
                                     8, None)
    assert (params.temperature, params.top_k) == (0.0, 5)
    params = _serving({}).sampling_params(CompletionRequest(prompt="x"), 8, None)
    assert (params.temperature, params.top_k) == (1.0, 0)


def test_override_generation_config_extends_and_replaces_the_defaults(tmp_path: Path) -> None:
    model = str(_model_with(tmp_path, SAMPLING))
    config = ModelConfig(model, override_generation_config={"temperature": 0.5, "min_p": 0.1})
    assert config.sampling_defaults == {"temperature": 0.5, "top_p": 0.8, "top_k": 20,
                                        "repetition_penalty": 1.1, "min_p": 0.1}
    # With "vllm" only the overrides apply; null drops the model's value.
    only = ModelConfig(model, generation_config="vllm", override_generation_config={"top_k": 5})
    assert only.sampling_defaults == {"top_k": 5}
    dropped = ModelConfig(model, override_generation_config={"top_k": None})
    assert "top_k" not in dropped.sampling_defaults and dropped.sampling_defaults["top_p"] == 0.8


@pytest.mark.parametrize(("override", "message"), [
    ({"max_new_tokens": 9}, "'max_new_tokens' not supported here"),
    ({"temperature": -1}, r"override-generation-config\.temperature: must be non-negative"),
    ({"top_k": "x"}, r"override-generation-config\.top_k"),
    ([0.5], "must be a JSON object"),
])
def test_bad_override_generation_config_is_refused(override, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig("demo-tiny", override_generation_config=override)

