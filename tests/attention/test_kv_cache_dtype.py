"""Tests vllm/attention/kv_cache_dtype.py and `--kv-cache-dtype fp8` end to end: the flag's
values, the cache's size at a fixed memory budget, and greedy outputs against a
full-precision cache (with the checkpoint's own k_scale / v_scale), also under tensor
parallelism in worker processes, speculative decoding and structured outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.utils_models import build_checkpoint
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.attention.kv_cache_dtype import (
    FP8_DTYPE,
    FP8_MAX,
    check_kv_cache_dtype,
    kv_cache_torch_dtype,
    quantize_fp8,
)
from vllm.model_executor.model_loader.demo_model import build_demo_model
from vllm.v1.worker.kv_cache_memory import kv_block_bytes

PROMPTS = [[(7 * i + 3 * k) % 500 + 1 for k in range(4 + 3 * i)] for i in range(8)]
MAX_TOKENS = 32
TOP_K = 5
# Scales written into the test checkpoint: not 1.0, so a scale lost on the way from the file
# to the kernels changes the outputs by far more than FP8 rounding does.
K_SCALE, V_SCALE = 0.5, 0.25
# Largest change FP8 rounding may make to the logprob of the same token after the same
# context (measured: about 0.06 on this checkpoint; a lost scale moves it by whole nats).
MAX_LOGPROB_SHIFT = 0.2


def test_flag_values() -> None:
    for name in ("auto", "fp8", "fp8_e4m3"):
        assert check_kv_cache_dtype(name) == name
    for bad in ("fp16", "fp8_e5m2", "", None):
        with pytest.raises(ValueError, match="--kv-cache-dtype: .* choose one of auto, fp8"):
            check_kv_cache_dtype(bad)
    assert kv_cache_torch_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.float32) is FP8_DTYPE
    assert kv_cache_torch_dtype("fp8_e4m3", torch.bfloat16) is FP8_DTYPE


def test_quantize_scales_and_saturates() -> None:
    x = torch.tensor([1.0, -3.0, 1e6, -1e6, 0.0])
    q = quantize_fp8(x, 0.5)
    assert q.dtype == FP8_DTYPE
    assert q.float().tolist() == [2.0, -6.0, FP8_MAX, -FP8_MAX, 0.0]


def test_an_fp8_block_is_half_a_16_bit_one_and_a_quarter_of_float32() -> None:
    shape = dict(num_layers=28, block_size=16, num_kv_heads=8, head_dim=128)
    fp8 = kv_block_bytes(**shape, dtype=FP8_DTYPE)
    assert kv_block_bytes(**shape, dtype=torch.bfloat16) == 2 * fp8
    assert kv_block_bytes(**shape, dtype=torch.float16) == 2 * fp8
    assert kv_block_bytes(**shape, dtype=torch.float32) == 4 * fp8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose checkpoint carries per-layer k_scale / v_scale."""
    path = tmp_path_factory.mktemp("llama_kv_scales")
    build_checkpoint("llama", path, seed=5)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(K_SCALE)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(V_SCALE)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def make_llm(checkpoint: Path, **kwargs) -> LLM:
    return LLM(str(checkpoint), tokenizer=str(build_demo_model("demo-tiny")),
               max_model_len=128, max_num_seqs=8, **kwargs)


def num_blocks(llm: LLM) -> int:
    return llm.llm_engine.engine_core.num_blocks


@pytest.mark.parametrize(("dtype", "ratio"), [("float32", 4), ("bfloat16", 2)])
def test_a_fixed_budget_holds_more_blocks(checkpoint: Path, dtype: str, ratio: int) -> None:
    """At the same --kv-cache-memory the FP8 cache has 2x the blocks of a bfloat16 one and
    4x those of a float32 one."""
    counts = {}
    for cache_dtype in ("auto", "fp8"):
        llm = make_llm(checkpoint, dtype=dtype, kv_cache_dtype=cache_dtype,
                       kv_cache_memory=1 << 20, load_format="dummy")
        try:
            counts[cache_dtype] = num_blocks(llm)
            runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
            want = FP8_DTYPE if cache_dtype == "fp8" else getattr(torch, dtype)
            assert {c.dtype for c in runner.kv_caches} == {want}
        finally:
            llm.shutdown()
    assert counts["fp8"] >= 0.95 * ratio * counts["auto"], counts
    assert counts["fp8"] >= 1.9 * counts["auto"], counts


def greedy(llm: LLM) -> list:
    """Greedy completions of PROMPTS with the top TOP_K logprobs of every token."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def agreement(ref: list, other: list) -> tuple[int, int, float]:
    """(prompts with identical tokens, prompts that agree, largest logprob shift).

    Two completions agree as upstream vLLM's logprob check defines it: identical, or, where
    they first differ, each one's token is among the other's top TOP_K (a near tie that
    rounding may break either way; after it the contexts differ and nothing is compared).
    The shift is over the positions before the first difference, whose contexts are equal.
    """
    identical = agree = 0
    shift = 0.0
    for a, b in zip(ref, other, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     None)
        for i in range(MAX_TOKENS if first is None else first):
            token = a.token_ids[i]
            shift = max(shift, abs(a.logprobs[i][token].logprob - b.logprobs[i][token].logprob))
        if first is None:
            identical += 1
            agree += 1
        elif b.token_ids[first] in a.logprobs[first] and a.token_ids[first] in b.logprobs[first]:
            agree += 1
    return identical, agree, shift


@pytest.fixture(scope="module")
def outputs(checkpoint: Path) -> dict[str, list]:
    """Greedy completions with a float32 cache and with an FP8 one (the checkpoint's
    scales), both with async scheduling and prefix caching (the defaults)."""
    out = {}
    for cache_dtype in ("auto", "fp8"):
        llm = make_llm(checkpoint, dtype="float32", kv_cache_dtype=cache_dtype)
        try:
            out[cache_dtype] = greedy(llm)
            if cache_dtype == "fp8":
                runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
                layers = runner.model.model.layers
                assert {(x.self_attn.attn.k_scale, x.self_attn.attn.v_scale)
                        for x in layers} == {(K_SCALE, V_SCALE)}
        finally:
            llm.shutdown()
    return out


def test_greedy_outputs_agree_with_a_full_precision_cache(outputs: dict[str, list]) -> None:
    identical, agree, shift = agreement(outputs["auto"], outputs["fp8"])
    summary = f"{identical}/8 identical, {agree}/8 agree, largest logprob shift {shift:.3f}"
    assert agree >= 0.9 * len(PROMPTS), summary
    assert shift <= MAX_LOGPROB_SHIFT, summary


def _cache_of_rank(worker) -> tuple[str, int, float, float]:
    """(cache dtype, blocks, first layer's k_scale and v_scale) of one worker's runner."""
    runner = worker.model_runner
    attn = runner.model.model.layers[0].self_attn.attn
    return str(runner.kv_caches[0].dtype), runner.kv_caches[0].shape[1], attn.k_scale, \
        attn.v_scale


@pytest.mark.slow
def test_tensor_parallel_ranks_in_worker_processes(
    checkpoint: Path, outputs: dict[str, list]
) -> None:
    """-tp 2 with the mp executor: every rank holds an FP8 cache of the same number of
    blocks with the checkpoint's scales, and the outputs agree with one rank's."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs when CUDA is present")
    llm = make_llm(checkpoint, dtype="float32", kv_cache_dtype="fp8", tensor_parallel_size=2,
                   distributed_executor_backend="mp")
    try:
        ranks = llm.llm_engine.engine_core.model_executor.collective_rpc(_cache_of_rank)
        parallel = greedy(llm)
        assert ranks == [("torch.float8_e4m3fn", num_blocks(llm), K_SCALE, V_SCALE)] * 2
    finally:
        llm.shutdown()
    identical, agree, _ = agreement(outputs["fp8"], parallel)
    assert agree == len(PROMPTS), identical


def test_drafts_and_sync_scheduling_change_no_output(
    checkpoint: Path, outputs: dict[str, list]
) -> None:
    """Multi-token verification steps, run synchronously, write and read the FP8 cache as
    the single-token steps of async scheduling do; cached prefixes read back as computed."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = make_llm(checkpoint, dtype="float32", kv_cache_dtype="fp8", speculative_config=spec,
                   async_scheduling=False)
    try:
        got = greedy(llm)
        # Prompts that share 32 tokens, twice: the second pass reads its prefix from FP8
        # blocks the first pass wrote, and must produce what the first did.
        shared = [{"prompt_token_ids": [400 + k for k in range(32)] + p} for p in PROMPTS[:4]]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        first, second = (llm.generate(shared, params, use_tqdm=False) for _ in range(2))
        stats = llm.llm_engine.engine_core.make_stats()
    finally:
        llm.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in outputs["fp8"]]
    assert stats.kv.prefix_cache_hits >= 4 * 32, stats
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]


def test_structured_outputs_with_drafts_on_an_fp8_cache() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    llm = LLM("demo-tiny", kv_cache_dtype="fp8", max_model_len=256, max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    try:
        params = SamplingParams(max_tokens=64, temperature=0.0,
                                structured_outputs=StructuredOutputsParams(json=schema))
        outs = llm.generate(["a number:", "another:"], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for out in outs:
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"ok"} and isinstance(value["ok"], bool), out.outputs[0].text


def test_a_bad_value_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype: 'fp16' is not supported"):
        LLM("demo-tiny", kv_cache_dtype="fp16")


def test_old_gpus_are_refused_for_triton_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.attention.backends.torch_backend import TorchAttentionBackend
    from vllm.attention.backends.triton_backend import TritonAttentionBackend
    from vllm.attention.kv_cache_dtype import check_fp8_cache_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: .* 8.9 or newer.* is 8.0"):
        check_fp8_cache_device(cuda, TritonAttentionBackend.fp8_min_capability)
    check_fp8_cache_device(cuda, TorchAttentionBackend.fp8_min_capability)
    check_fp8_cache_device(torch.device("cpu"), TritonAttentionBackend.fp8_min_capability)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_cache_device(cuda, TritonAttentionBackend.fp8_min_capability)
