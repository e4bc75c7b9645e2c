"""Oracles for GGUF files: every tensor type loads as the `gguf` package dequantizes it, a
whole tiny model (llama, qwen2, qwen3) computes transformers' logits from the same file,
and broken or unsupported files are clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.utils_gguf import write_gguf
from tests.utils_models import capture_logits
from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.model_executor.model_loader.gguf_loader import SUPPORTED_TYPES, iterate_gguf
from vllm.transformers_utils.gguf_dir import gguf_model_dir


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))


def _config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
def test_each_type_loads_as_gguf_dequantizes_it(tmp_path, kind) -> None:
    import gguf

    path = write_gguf(tmp_path / f"m-{kind}.gguf", "qwen3", kind, seed=1)
    model_dir = gguf_model_dir(path)
    got = dict(iterate_gguf(model_dir / "model.gguf", _config(model_dir)))
    reader = gguf.GGUFReader(str(path))
    matrices = 0
    for tensor in reader.tensors:
        want = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        if tensor.data.ndim == 2 and tensor.tensor_type.name == kind:
            matrices += 1
        hf = _hf_name(tensor.name)
        assert np.isfinite(want).all()
        assert torch.equal(got[hf].read(), torch.from_numpy(want)), hf
    assert matrices == 1 + 1 + 2 * 7  # embedding, LM head, seven per layer
    assert len(got) == len(reader.tensors)


def _hf_name(gguf_name: str) -> str:
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return f"{names[parts[0]]}.{parts[1]}"


@pytest.mark.parametrize("arch,kind", [("llama", "Q8_0"), ("qwen2", "Q4_K"),
                                       ("qwen3", "Q6_K")])
def test_engine_equals_transformers_on_the_same_file(tmp_path, arch, kind) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_gguf(tmp_path / f"{arch}.gguf", arch, kind, seed=2)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=4)
    try:
        captured = capture_logits(llm)
        prompts = [[5, 9, 40, 3], [35, 3, 39], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            tokens = list(out.outputs[0].token_ids)
            with torch.inference_mode():
                ids = torch.tensor([prompt + tokens[:-1]])
                want = hf(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:]
            got = torch.stack(captured[out.request_id])
            # Random K-quant blocks make logits of ~100, where float32 itself rounds at
            # ~1e-5: the bound is 1e-4 relative to the logits' size (absolute below 1).
            assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
            assert tokens == want.argmax(-1).tolist()
        # The file's own tokenizer and chat template.
        tok = llm.get_tokenizer()
        assert tok("hello world").input_ids == hf_tok("hello world").input_ids
        assert len(tok("hello world").input_ids) == 3  # merged words, a space between
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True).endswith("assistant\n")
    finally:
        llm.shutdown()


def test_converted_directory_is_reused(tmp_path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", "F16")
    first = gguf_model_dir(path)
    marker = first / "config.json"
    before = marker.stat().st_mtime_ns
    assert gguf_model_dir(path) == first and marker.stat().st_mtime_ns == before
    assert (first / "model.gguf").resolve() == path.resolve()


# ----------------------------------------------------------------------------- errors


def _start_error(model: str, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        LLM(model, dtype="float32", max_model_len=64, **kwargs)
    return str(info.value)


def test_truncated_file_names_the_file(tmp_path) -> None:
    path = write_gguf(tmp_path / "full.gguf", "llama", "Q4_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    message = _start_error(str(cut))
    assert "cut.gguf" in message and ("truncated" in message or "not a readable" in message)


def test_not_a_gguf_file(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    assert "bad.gguf" in _start_error(str(bad))


def test_unsupported_architecture_names_the_key(tmp_path) -> None:
    path = write_gguf(tmp_path / "falcon.gguf", "falcon", "F32")
    message = _start_error(str(path))
    assert "general.architecture" in message and "falcon" in message


def test_unsupported_tensor_type_names_file_and_tensor(tmp_path) -> None:
    path = write_gguf(tmp_path / "iq.gguf", "llama", "IQ4_NL")
    message = _start_error(str(path))
    assert "iq.gguf" in message and "IQ4_NL" in message and "token_embd.weight" in message


def test_tensor_without_a_place_names_it(tmp_path) -> None:
    path = write_gguf(tmp_path / "x.gguf", "llama", "F32",
                      extra_tensor=("blk.0.mystery.weight", "F32"))
    assert "blk.0.mystery.weight" in _start_error(str(path))


def test_tokenizer_that_does_not_match(tmp_path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", "F32")
    message = _start_error(str(path), tokenizer=str(build_demo_model("demo-tiny")))
    assert "--tokenizer" in message and "512" in message


def test_file_without_tokenizer_asks_for_one(tmp_path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", "F32", tokenizer=False)
    assert "--tokenizer" in _start_error(str(path))


def test_load_format_gguf_needs_a_gguf_model() -> None:
    message = _start_error("demo-tiny", load_format="gguf")
    assert "--load-format gguf" in message


def test_hf_config_path_replaces_the_file_config(tmp_path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", "F32")
    config = _config(gguf_model_dir(path))
    config.max_position_embeddings = 96
    (tmp_path / "cfg").mkdir()
    config.save_pretrained(str(tmp_path / "cfg"))
    llm = LLM(str(path), hf_config_path=str(tmp_path / "cfg"), dtype="float32")
    try:
        assert llm.llm_engine.vllm_config.model_config.max_model_len == 96
    finally:
        llm.shutdown()
