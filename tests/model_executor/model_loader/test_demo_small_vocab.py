"""Tests for vllm/model_executor/model_loader/demo_small_vocab.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
from safetensors import safe_open

from vllm.model_executor.model_loader.demo_model import BUILD_VERSION, DEMO_MODELS
from vllm.model_executor.model_loader.demo_small_vocab import (
    SMALL_VOCAB_MODELS,
    build_small_vocab_model,
    resolve,
)
from vllm.transformers_utils.qwen_vocab import ADDED_TOKENS, load_ranks
from vllm.transformers_utils.tokenizer import get_tokenizer

SPEC = SMALL_VOCAB_MODELS["demo-small-vocab"]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def model_dir(cache_root: Path) -> Path:
    return build_small_vocab_model("demo-small-vocab", cache_root)


def test_spec() -> None:
    assert SPEC.body == DEMO_MODELS["demo-tiny"]
    assert SPEC.num_base_tokens == 8192 and SPEC.vocab_size >= 8192 + len(ADDED_TOKENS)
    assert (SPEC.eos_token_id, SPEC.pad_token_id) == (8194, 8192)


def test_layout_and_cache(model_dir: Path, cache_root: Path) -> None:
    assert model_dir == cache_root / "demo-models" / f"demo-small-vocab-{BUILD_VERSION}"
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "model.safetensors"} <= names
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_small_vocab_model("demo-small-vocab", cache_root) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert resolve("demo-small-vocab", cache_root) == model_dir
    assert resolve("demo-tiny", cache_root) is None and resolve(None, cache_root) is None
    with pytest.raises(ValueError, match="demo-huge"):
        build_small_vocab_model("demo-huge", cache_root)


def test_config_and_weights(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == SPEC.vocab_size
    assert (config["eos_token_id"], config["pad_token_id"]) == (8194, 8192)
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [8194, 8192]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("model.embed_tokens.weight").get_shape()) == (SPEC.vocab_size, 64)


def test_tokenizer_is_the_first_ranks_of_qwen(model_dir: Path) -> None:
    tok = get_tokenizer(model_dir)
    assert len(tok) == SPEC.num_base_tokens + len(ADDED_TOKENS)
    for i, (content, _) in enumerate(ADDED_TOKENS):
        assert tok.convert_tokens_to_ids(content) == SPEC.num_base_tokens + i
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 8194
    ranks = load_ranks()
    # Tokens kept from Qwen's vocabulary keep their ids.
    for text in (" the", " world", "{", '":"', "name"):
        assert ranks[text.encode()] < SPEC.num_base_tokens
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == [ranks[text.encode()]], text
    # A token beyond the kept ranks is split into kept ones.
    assert ranks[b"Hello"] >= SPEC.num_base_tokens
    assert len(tok.encode("Hello", add_special_tokens=False)) > 1
    text = 'Ünïcode, digits 12345 and {"json": true} <|im_end|>'
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[-1] == 8194 and all(i < SPEC.num_base_tokens for i in ids[:-1])
    assert tok.decode(ids) == text
    assert "<|im_start|>assistant\n" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_engine_writes_valid_json(model_dir: Path) -> None:
    from vllm import LLM, SamplingParams

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    llm = LLM(str(model_dir), max_num_seqs=4, max_model_len=256)
    try:
        params = SamplingParams(
            temperature=0, max_tokens=48,
            structured_outputs={"json": schema, "disable_any_whitespace": True},
        )
        outs = llm.generate(["Profile:", "Another profile:"], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop"
        assert all(t < SPEC.vocab_size for t in completion.token_ids)
        jsonschema.validate(json.loads(completion.text), schema)


def test_deep_model_builds_and_loads(cache_root: Path) -> None:
    deep = SMALL_VOCAB_MODELS["demo-small-vocab-deep"]
    body = deep.body
    assert (body.hidden_size, body.num_hidden_layers, body.intermediate_size) == (512, 8, 1536)
    assert (deep.num_base_tokens, deep.vocab_size) == (SPEC.num_base_tokens, SPEC.vocab_size)
    path = build_small_vocab_model("demo-small-vocab-deep", cache_root)
    assert path == cache_root / "demo-models" / f"demo-small-vocab-deep-{BUILD_VERSION}"
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (512, 8)
    assert (config["vocab_size"], config["eos_token_id"]) == (8256, 8194)
    shapes = _shapes(path)
    assert shapes["model.embed_tokens.weight"] == (8256, 512)
    assert "model.layers.7.mlp.down_proj.weight" in shapes
    # The decoder layers, not the tied LM head, hold most of the weights.
    layer_params = sum(math.prod(s) for name, s in shapes.items() if ".layers." in name)
    assert layer_params > 5 * 8256 * 512

    from vllm import LLM, SamplingParams

    llm = LLM(str(path), max_num_seqs=2, max_model_len=128)
    try:
        out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
    ids = out[0].outputs[0].token_ids
    assert 1 <= len(ids) <= 4 and all(t < deep.vocab_size for t in ids)


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
