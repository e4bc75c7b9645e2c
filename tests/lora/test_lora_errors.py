"""Bad adapters and bad LoRA options are clear errors for the caller, never an engine crash:
each names the file and, where one is at fault, the tensor key."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tests.lora.utils import build_adapter
from tests.utils_models import build_checkpoint
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import InvalidRequestError
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.v1.engine import EngineCoreRequest

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(root dir, HF model, engine with max_lora_rank 4)."""
    root = tmp_path_factory.mktemp("lora_errors")
    hf = build_checkpoint("qwen3", root / "model", seed=3)
    llm = LLM(model=str(root / "model"), tokenizer=str(build_demo_model("demo-tiny")),
              dtype="float32", max_model_len=64, enable_lora=True, max_lora_rank=4)
    yield root, hf, llm
    llm.shutdown()


def _rejects(llm: LLM, lora: LoRARequest, *fragments: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([PROMPT], PARAMS, use_tqdm=False, lora_request=lora)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    # Nothing was queued, and the engine still serves.
    assert not llm.llm_engine.has_unfinished_requests()
    (out,) = llm.generate([PROMPT], PARAMS, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_rank_above_max_lora_rank(setup) -> None:
    root, hf, llm = setup
    build_adapter(hf, root / "r8", seed=1, targets=["q_proj"], r=8)
    _rejects(llm, LoRARequest("r8", 1, str(root / "r8")),
             str(root / "r8" / "adapter_config.json"), "'r' is 8", "--max-lora-rank 4")


def test_target_module_outside_the_supported_ones(setup) -> None:
    root, hf, llm = setup
    build_adapter(hf, root / "head", seed=2, targets=["q_proj", "lm_head"], r=2)
    _rejects(llm, LoRARequest("head", 2, str(root / "head")),
             "adapter_model.safetensors", "tensor 'base_model.model.lm_head.")


def test_missing_and_corrupt_files(setup) -> None:
    root, hf, llm = setup
    _rejects(llm, LoRARequest("nowhere", 3, str(root / "nowhere")),
             str(root / "nowhere" / "adapter_config.json"), "file not found")
    build_adapter(hf, root / "broken", seed=3, targets=["v_proj"], r=2)
    weights = root / "broken" / "adapter_model.safetensors"
    weights.write_bytes(b"\x00\x01 not a safetensors file")
    _rejects(llm, LoRARequest("broken", 4, str(root / "broken")), str(weights), "safetensors")
    weights.unlink()
    _rejects(llm, LoRARequest("broken", 5, str(root / "broken")), str(weights), "not found")


def test_wrong_shape_names_the_key(setup, tmp_path) -> None:
    """An adapter trained for another model (Llama: q_proj of 64 rows, not 128)."""
    root, _, llm = setup
    llama = build_checkpoint("llama", tmp_path / "llama", seed=4)
    build_adapter(llama, root / "llama_lora", seed=5, targets=["q_proj"], r=2)
    _rejects(llm, LoRARequest("llama", 6, str(root / "llama_lora")),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", "shape")


def test_lora_request_needs_enable_lora(setup) -> None:
    root, hf, _ = setup
    build_adapter(hf, root / "ok", seed=7, targets=["o_proj"], r=2)
    llm = LLM(model=str(root / "model"), tokenizer=str(build_demo_model("demo-tiny")),
              dtype="float32", max_model_len=64)
    _rejects(llm, LoRARequest("ok", 7, str(root / "ok")), "--enable-lora")
    llm.shutdown()


def test_bad_lora_request_fields(setup) -> None:
    root, hf, llm = setup
    build_adapter(hf, root / "ok2", seed=8, targets=["o_proj"], r=2)
    _rejects(llm, LoRARequest("ok2", 0, str(root / "ok2")), "lora_int_id")
    with pytest.raises(ValueError, match="lora_request: got 2 for 1 prompts"):
        llm.generate([PROMPT], PARAMS, use_tqdm=False,
                     lora_request=[LoRARequest("ok2", 8, str(root / "ok2"))] * 2)


def test_engine_args_and_config() -> None:
    """Upstream's flags and defaults; refused combinations name the flag."""
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32"]))
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 3, 32)
    config = EngineArgs(model="demo-tiny", enable_lora=True, max_loras=3).create_engine_config()
    assert config.lora_config is not None
    assert (config.lora_config.max_loras, config.lora_config.max_lora_rank,
            config.lora_config.max_cpu_loras) == (3, 16, 3)
    assert EngineArgs(model="demo-tiny").create_engine_config().lora_config is None
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        EngineArgs(model="demo-tiny", enable_lora=True, max_loras=2,
                   max_cpu_loras=1).create_engine_config()
    with pytest.raises(ValueError, match="--max-loras"):
        EngineArgs(model="demo-tiny", enable_lora=True, max_loras=0).create_engine_config()


def test_architectures_without_adapters_are_refused(tmp_path) -> None:
    from tests.utils_models import hf_config

    hf_config("qwen3_moe").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--enable-lora: architecture.*Qwen3MoeForCausalLM"):
        EngineArgs(model=str(tmp_path), enable_lora=True).create_engine_config()


def test_lora_request_crosses_as_typed_data() -> None:
    request = EngineCoreRequest("r1", [1, 2], SamplingParams(), 0.0, LoRARequest("a", 3, "/x/y"))
    data = msgspec.msgpack.encode(request)
    back = msgspec.msgpack.decode(data, type=EngineCoreRequest)
    assert back.lora_request == LoRARequest("a", 3, "/x/y")
    assert isinstance(back.lora_request, LoRARequest)
    # Without an adapter the wire format is what it was.
    plain = EngineCoreRequest("r1", [1, 2], SamplingParams(), 0.0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plain), type=EngineCoreRequest) == plain
    assert LoRARequest("a", 3, "/p").cache_salt != LoRARequest("b", 4, "/p").cache_salt
    assert torch is not None


def test_an_adapter_that_breaks_after_admission_fails_only_its_request(
    setup, monkeypatch
) -> None:
    """The front end checked the adapter; by the time a worker reads it, its files changed.
    That request ends with an error naming the file; the others in its step, and the
    engine, go on."""
    root, hf, llm = setup
    build_adapter(hf, root / "late", seed=9, targets=["q_proj"], r=2)
    from vllm.lora import model_manager

    real = model_manager.load_adapter

    def changed_on_disk(directory: str, *args):
        if directory == str(root / "late"):
            raise ValueError(f"{directory}/adapter_model.safetensors: changed on disk")
        return real(directory, *args)

    monkeypatch.setattr(model_manager, "load_adapter", changed_on_disk)
    late = LoRARequest("late", 9, str(root / "late"))
    broken, fine = llm.generate([PROMPT, PROMPT], PARAMS, use_tqdm=False,
                                lora_request=[late, None])
    assert broken.outputs[0].finish_reason == "error"
    assert "changed on disk" in broken.outputs[0].error
    assert len(fine.outputs[0].token_ids) == 3 and fine.outputs[0].finish_reason == "length"
    assert not llm.llm_engine.has_unfinished_requests()
    (again,) = llm.generate([PROMPT], PARAMS, use_tqdm=False)
    assert len(again.outputs[0].token_ids) == 3
