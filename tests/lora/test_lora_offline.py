"""Oracles for LoRA adapters through the offline engine (LLM).

Tiny random Qwen3 and Llama checkpoints get random PEFT adapters (every projection, or a
subset; plain and rsLoRA scaling). The engine must produce peft's merge_and_unload() model's
greedy tokens and logits for each adapter; a batch mixing adapters and the base model must
give each request what it gets alone, also when the adapters outnumber --max-loras (they
wait) and after their slots and host copies were evicted (they are reloaded).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.lora.utils import ALL_TARGETS, build_adapter
from tests.utils_models import TINY, build_checkpoint, capture_logits
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader.demo_model import build_demo_model

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT_LENS = [3, 9, 14, 21, 6]


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    return str(build_demo_model("demo-tiny"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(model dir, HF model, {name: (LoRARequest, merged HF model)})."""
    root = tmp_path_factory.mktemp("qwen3_lora")
    hf = build_checkpoint("qwen3", root / "model", seed=0)
    adapters = {
        "all": (1, ALL_TARGETS, dict(r=4, alpha=8.0)),
        "attn_down": (2, ["q_proj", "v_proj", "down_proj"], dict(r=8, alpha=4.0,
                                                                 use_rslora=True)),
        "mlp": (3, ["gate_proj", "up_proj"], dict(r=2, alpha=2.0)),
    }
    made = {}
    for name, (lora_id, targets, kw) in adapters.items():
        path = root / name
        merged = build_adapter(hf, path, seed=10 + lora_id, targets=targets, **kw)
        made[name] = (LoRARequest(name, lora_id, str(path)), merged)
    return root / "model", hf, made


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


def _engine(path, tokenizer_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 128)
    kwargs.setdefault("block_size", 4)
    return LLM(model=str(path), tokenizer=tokenizer_dir, dtype="float32", enable_lora=True,
               **kwargs)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.model_executor.worker.model_runner


def _check_against(hf, prompt, out, captured) -> None:
    tokens = out.outputs[0].token_ids
    assert len(tokens) == MAX_TOKENS
    with torch.inference_mode():
        want = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    got = torch.stack(captured[out.request_id])
    assert (got - want).abs().max().item() < 1e-4
    assert tokens == want.argmax(-1).tolist()


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def engine(qwen3, tokenizer_dir):
    path, _, _ = qwen3
    llm = _engine(path, tokenizer_dir, max_loras=2, max_cpu_loras=2)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def alone(qwen3, engine) -> dict[tuple[str | None, int], list[int]]:
    """Greedy tokens of each prompt run by itself, per adapter (None: base model)."""
    _, _, adapters = qwen3
    results = {}
    for name in [None, *adapters]:
        lora = adapters[name][0] if name else None
        for i, prompt in enumerate(_prompts(1)):
            (out,) = engine.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
            results[(name, i)] = out.outputs[0].token_ids
    return results


def test_each_adapter_matches_merged_peft_model(qwen3, engine) -> None:
    _, hf, adapters = qwen3
    captured = capture_logits(engine)
    prompts = _prompts(2)
    base_out = engine.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, base_out):
        _check_against(hf, prompt, out, captured)
    for name, (lora, merged) in adapters.items():
        outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
        for prompt, out in zip(prompts, outs):
            _check_against(merged, prompt, out, captured)
        # Each adapter really changes the model (else this test could not fail).
        assert _tokens(outs) != _tokens(base_out), name


def test_mixed_batch_equals_alone(qwen3, engine, alone) -> None:
    """Two adapters and the base model in one batch (max_loras=2: one step holds them)."""
    _, _, adapters = qwen3
    names = [None, "all", "attn_down", "all", None]
    prompts = _prompts(1)
    loras = [adapters[n][0] if n else None for n in names]
    outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for i, (name, out) in enumerate(zip(names, outs)):
        assert out.outputs[0].token_ids == alone[(name, i)], (name, i)


def test_more_adapters_than_slots_wait_and_reload(qwen3, tokenizer_dir, alone, monkeypatch):
    """max_loras=1, max_cpu_loras=1: three adapters and the base in one generate call. No step
    holds two adapters; adapters are evicted and read again; every request gets what it gets
    alone."""
    import vllm.lora.model_manager as manager_module

    path, _, adapters = qwen3
    llm = _engine(path, tokenizer_dir, max_loras=1)
    manager = _runner(llm).lora
    assert manager is not None and manager.config.max_cpu_loras == 1
    reads: list[str] = []
    real_load = manager_module.load_adapter

    def counting_load(directory, *args):
        reads.append(directory)
        return real_load(directory, *args)

    monkeypatch.setattr(manager_module, "load_adapter", counting_load)
    per_step: list[set[int]] = []
    real_activate = manager.activate

    def recording_activate(requests):
        per_step.append({r.lora_int_id for r in requests if r is not None})
        return real_activate(requests)

    manager.activate = recording_activate
    names = ["all", "mlp", None, "attn_down", "all"]
    prompts = _prompts(1)
    for order in (range(5), range(4, -1, -1)):  # the second order evicts differently
        loras = [adapters[names[i]][0] if names[i] else None for i in order]
        outs = llm.generate([prompts[i] for i in order], GREEDY, use_tqdm=False,
                            lora_request=loras)
        for i, out in zip(order, outs):
            assert out.outputs[0].token_ids == alone[(names[i], i)], (names[i], i)
    assert max(len(s) for s in per_step) == 1
    # Three distinct adapters through one host slot: each is read more than once.
    assert len(reads) > 3
    assert len(manager.host) == 1 and len(manager.slots) == 1
    llm.shutdown()


def test_prefix_cache_is_per_adapter(qwen3, engine) -> None:
    _, _, adapters = qwen3
    lora_a, lora_b = adapters["all"][0], adapters["attn_down"][0]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = list(range(100, 125))  # six full blocks of 4
    (first,) = engine.generate([prompt], params, use_tqdm=False, lora_request=lora_a)
    assert first.num_cached_tokens == 0
    (same,) = engine.generate([prompt], params, use_tqdm=False, lora_request=lora_a)
    assert same.num_cached_tokens == 24
    (other,) = engine.generate([prompt], params, use_tqdm=False, lora_request=lora_b)
    assert other.num_cached_tokens == 0
    (base,) = engine.generate([prompt], params, use_tqdm=False)
    assert base.num_cached_tokens == 0
    (base_again,) = engine.generate([prompt], params, use_tqdm=False)
    assert base_again.num_cached_tokens == 24
    kv = engine.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_llama_subset_adapter_matches_merged(tmp_path, tokenizer_dir) -> None:
    hf = build_checkpoint("llama", tmp_path / "model", seed=5)
    merged = build_adapter(hf, tmp_path / "adapter", seed=6, targets=["k_proj", "o_proj",
                                                                       "up_proj"], r=3)
    llm = _engine(tmp_path / "model", tokenizer_dir, max_lora_rank=8)
    captured = capture_logits(llm)
    lora = LoRARequest("llama-adapter", 7, str(tmp_path / "adapter"))
    prompts = _prompts(3)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    for prompt, out in zip(prompts, outs):
        _check_against(merged, prompt, out, captured)
    llm.shutdown()


def test_triton_backend_matches_merged_models(qwen3, tokenizer_dir, alone, monkeypatch) -> None:
    """VLLM_LORA_BACKEND=triton (Triton's interpreter without CUDA): a batch mixing two
    adapters and the base model gives each request its merged model's logits and greedy
    tokens, and the tokens the torch backend gives it alone."""
    path, hf, adapters = qwen3
    monkeypatch.setenv("VLLM_LORA_BACKEND", "triton")
    llm = _engine(path, tokenizer_dir, max_loras=2)
    assert _runner(llm).lora.batch.backend == "triton"
    captured = capture_logits(llm)
    names = [None, "all", "attn_down", "all", None]
    loras = [adapters[n][0] if n else None for n in names]
    outs = llm.generate(_prompts(1), GREEDY, use_tqdm=False, lora_request=loras)
    for i, (name, prompt, out) in enumerate(zip(names, _prompts(1), outs)):
        _check_against(adapters[name][1] if name else hf, prompt, out, captured)
        assert out.outputs[0].token_ids == alone[(name, i)], (name, i)
    llm.shutdown()
