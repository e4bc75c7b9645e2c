"""Tests Qwen3/Qwen2/Llama forward passes, weight loading and the registry against transformers."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.utils_attention import ReqStep, allocate_blocks, make_metadata
from tests.utils_models import LLAMA3_ROPE, TINY, build_checkpoint, hf_config as _hf_config
from vllm.config import ModelConfig
from vllm.model_executor.model_loader.loader import get_model
from vllm.model_executor.models.registry import get_model_class

CHECKPOINTS = ["qwen3", "qwen2", "llama", "llama3_rope", "mistral", "qwen3_sharded"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """name -> (checkpoint dir, Hugging Face model with the same weights)."""
    out = {}
    for i, name in enumerate(["qwen3", "qwen2", "llama", "llama3_rope", "mistral"]):
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, build_checkpoint(name, path, seed=i))
    path = tmp_path_factory.mktemp("qwen3_sharded")
    out["qwen3"][1].save_pretrained(path, max_shard_size="30KB")
    assert (path / "model.safetensors.index.json").is_file()
    out["qwen3_sharded"] = (path, out["qwen3"][1])
    return out


@pytest.fixture(scope="module")
def models(checkpoints) -> dict[str, torch.nn.Module]:
    return {
        name: get_model(ModelConfig(model=str(path), dtype="float32", attention_backend="torch"))
        for name, (path, _) in checkpoints.items()
    }


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


class PagedRunner:
    """Drives a model step by step over a paged KV cache, like the model runner does."""

    def __init__(self, model, seqs: list[list[int]], block_size: int, seed: int) -> None:
        self.model = model
        self.block_size = block_size
        self.block_ids, num_blocks = allocate_blocks(
            [len(s) for s in seqs], block_size, random.Random(seed)
        )
        shape = model.attn_backend_cls.kv_cache_shape(
            num_blocks, block_size, model.num_kv_heads, model.head_dim
        )
        self.device = next(model.parameters()).device
        # Garbage in the cache makes any read of an unwritten slot visible in the logits.
        self.kv_caches = [torch.randn(shape).to(self.device) for _ in range(model.num_layers)]
        self.seqs = seqs
        self.done = [0] * len(seqs)

    def step(self, num_new: dict[int, int], pad: int = 0) -> dict[int, torch.Tensor]:
        """Runs num_new[i] next tokens of each sequence i; returns their logits per sequence."""
        reqs = sorted(num_new)
        steps = [ReqStep(self.done[i], num_new[i], self.block_ids[i]) for i in reqs]
        meta, positions = make_metadata(steps, self.block_size, self.device, pad=pad)
        ids = [t for i in reqs for t in self.seqs[i][self.done[i] : self.done[i] + num_new[i]]]
        input_ids = torch.tensor(ids + [0] * pad, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            assert hidden.shape == (len(ids) + pad, self.model.hidden_size)
            logits = self.model.compute_logits(hidden[: len(ids)]).cpu()
        assert logits.dtype == torch.float32
        out, start = {}, 0
        for i in reqs:
            out[i] = logits[start : start + num_new[i]]
            start += num_new[i]
            self.done[i] += num_new[i]
        return out


def _sequences(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in lengths]


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert want.std() > 0.5  # the oracle's logits are far from trivial
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_varlen_prefill_then_paged_decode(name, checkpoints, models) -> None:
    hf, model = checkpoints[name][1], models[name]
    prompt_lens, decode_steps = [5, 11, 1, 8], 4
    seqs = _sequences([n + decode_steps for n in prompt_lens], seed=len(name))
    want = [hf_logits(hf, s) for s in seqs]
    runner = PagedRunner(model, seqs, block_size=4, seed=7)
    got = runner.step(dict(enumerate(prompt_lens)), pad=3)
    for i, n in enumerate(prompt_lens):
        _check(got[i], want[i][:n])
    for step in range(decode_steps):
        got = runner.step({i: 1 for i in range(len(seqs))})
        for i, n in enumerate(prompt_lens):
            _check(got[i], want[i][n + step : n + step + 1])


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_chunked_prefill_attends_to_cached_chunk(name, checkpoints, models) -> None:
    hf, model = checkpoints[name][1], models[name]
    seqs = _sequences([21, 8], seed=3)
    want = [hf_logits(hf, s) for s in seqs]
    runner = PagedRunner(model, seqs, block_size=16, seed=11)
    got = runner.step({0: 6, 1: 7})
    _check(got[0], want[0][:6])
    _check(got[1], want[1][:7])
    # Second chunk of 0 spans a block boundary, batched with the decode of 1.
    got = runner.step({0: 13, 1: 1})
    _check(got[0], want[0][6:19])
    _check(got[1], want[1][7:8])
    got = runner.step({0: 2})
    _check(got[0], want[0][19:21])


def test_model_attributes(checkpoints, models) -> None:
    from vllm.attention.backends.torch_backend import TorchAttentionBackend

    q3 = models["qwen3"]
    assert (q3.num_layers, q3.num_kv_heads, q3.head_dim) == (2, 2, 32)
    assert q3.attn_backend_cls is TorchAttentionBackend
    assert not q3.training
    assert q3.lm_head.weight is q3.model.embed_tokens.weight
    llama = models["llama"]
    assert llama.head_dim == 16
    assert not torch.equal(llama.lm_head.weight, llama.model.embed_tokens.weight)


def test_mistral_sliding_window_bounds_max_model_len(checkpoints, models) -> None:
    """MistralForCausalLM runs as Llama; its sliding_window (64) is honoured by serving no
    context longer than the window, where full attention is the same."""
    path = str(checkpoints["mistral"][0])
    assert type(models["mistral"]).__name__ == "LlamaForCausalLM"
    assert models["mistral"].head_dim == 32
    assert ModelConfig(model=path).max_model_len == 64  # the window, not the 256 positions
    assert ModelConfig(model=path, max_model_len=48).max_model_len == 48
    with pytest.raises(ValueError, match=r"--max-model-len: 65 exceeds the model's "
                                         r"sliding_window \(64\)"):
        ModelConfig(model=path, max_model_len=65)


def test_llama3_rope_frequencies_match_transformers(models) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    positions = torch.arange(0, 250, 7)
    rope = models["llama3_rope"].model.layers[0].self_attn.rotary_emb
    config = LlamaConfig(**TINY, rope_scaling=dict(LLAMA3_ROPE))
    x = torch.zeros(1, len(positions), 16)
    cos, sin = LlamaRotaryEmbedding(config)(x, positions[None])
    torch.testing.assert_close(rope.cos_cache[positions], cos[0, :, :8], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache[positions], sin[0, :, :8], rtol=0, atol=1e-6)
    # The scaling must matter, or this test could not tell it apart from plain RoPE.
    plain = LlamaConfig(**TINY, rope_theta=500000.0)
    plain_cos, _ = LlamaRotaryEmbedding(plain)(x, positions[None])
    assert (plain_cos[0, :, :8] - cos[0, :, :8]).abs().max() > 0.1


def _dummy(path: Path, seed: int, dtype: str = "float32") -> torch.nn.Module:
    return get_model(
        ModelConfig(model=str(path), dtype=dtype, load_format="dummy", seed=seed,
                    attention_backend="torch")
    )


def test_dummy_weights_are_seeded(tmp_path: Path) -> None:
    _hf_config("qwen2").save_pretrained(tmp_path)  # config only: no weights needed
    a, b, c = _dummy(tmp_path, 0), _dummy(tmp_path, 0), _dummy(tmp_path, 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(not torch.equal(sa[k], sc[k]) for k in sa)
    seqs = _sequences([6, 3], seed=0)
    runner = PagedRunner(a, seqs, block_size=4, seed=0)
    logits = runner.step({0: 6, 1: 3})
    assert all(torch.isfinite(v).all() for v in logits.values())


def test_bfloat16_model(tmp_path: Path) -> None:
    _hf_config("qwen3").save_pretrained(tmp_path)
    before = torch.get_default_dtype()
    model = _dummy(tmp_path, 0, dtype="bfloat16")
    assert torch.get_default_dtype() == before
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    seqs = _sequences([5], seed=0)
    runner = PagedRunner(model, seqs, block_size=4, seed=0)
    runner.kv_caches = [c.bfloat16() for c in runner.kv_caches]
    logits = runner.step({0: 5})[0]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def _copy_with(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_raises(checkpoints, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.bias"
    path = _copy_with(checkpoints["qwen2"][0], tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name):
        get_model(ModelConfig(model=str(path), dtype="float32"))


def test_misshapen_tensor_raises(checkpoints, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.up_proj.weight"

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1]

    path = _copy_with(checkpoints["llama"][0], tmp_path / "m", edit)
    with pytest.raises(ValueError, match=name):
        get_model(ModelConfig(model=str(path), dtype="float32"))


def test_unknown_tensor_raises(checkpoints, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.extra_proj.weight"

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.zeros(2, 2)

    path = _copy_with(checkpoints["qwen3"][0], tmp_path / "m", edit)
    with pytest.raises(ValueError, match=name):
        get_model(ModelConfig(model=str(path), dtype="float32"))


def test_unsupported_architecture_raises(checkpoints, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class(["GPT2LMHeadModel"])
    assert get_model_class(["Foo", "Qwen2ForCausalLM"]).__name__ == "Qwen2ForCausalLM"
    path = tmp_path / "m"
    shutil.copytree(checkpoints["qwen3"][0], path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM"):
        get_model(ModelConfig(model=str(path), dtype="float32"))
