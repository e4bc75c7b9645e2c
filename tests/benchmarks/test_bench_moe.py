"""Tests for benchmarks/bench_moe.py: the MoE it writes has the dense model's body and the
same MLP arithmetic per token (top_k experts of width I / top_k), and a bad top_k is refused."""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from tests.benchmarks.scripts import load_script
from vllm.model_executor.model_loader.demo_small_vocab import resolve

bench_moe = load_script("bench_moe")


def _mlp_params_per_token(path, config: dict) -> int:
    """MLP weights one token multiplies by in layer 0 (its top_k experts, or the MLP)."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.startswith("model.layers.0.mlp.")]
        sizes = {n: f.get_slice(n).get_shape() for n in names}
    experts = config.get("num_experts") or config.get("num_local_experts") or 1
    top_k = config.get("num_experts_per_tok", 1)
    router = "model.layers.0.mlp.gate.weight"
    total = sum(math.prod(shape) for name, shape in sizes.items() if name != router)
    return total * top_k // experts


def test_the_moe_matches_the_dense_model_per_token(tmp_path) -> None:
    dense = resolve("demo-small-vocab")
    bench_moe.write_moe(dense, tmp_path, num_experts=4, top_k=2)
    base = json.loads((dense / "config.json").read_text())
    moe = json.loads((tmp_path / "config.json").read_text())
    assert moe["architectures"] == ["Qwen3MoeForCausalLM"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert moe[key] == base[key], key
    assert moe["moe_intermediate_size"] * 2 == base["intermediate_size"]
    assert (_mlp_params_per_token(tmp_path, moe)
            == _mlp_params_per_token(dense, base))
    assert (tmp_path / "tokenizer.json").exists()


def test_a_top_k_that_does_not_divide_the_width_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="--top-k 7"):
        bench_moe.write_moe(resolve("demo-small-vocab"), tmp_path, num_experts=8, top_k=7)
