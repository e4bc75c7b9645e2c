"""Oracle: the engine's greedy tokens and per-step logits equal Hugging Face transformers'.

Random tiny Qwen3, Qwen2 and Llama checkpoints run through the whole offline engine (scheduler,
KV cache, model runner, sampler), plainly, with chunked prefill, with a forced prefix-cache hit,
and with forced preemption. Each special condition is asserted to have happened.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.utils_models import TINY, build_checkpoint, capture_logits
from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader.demo_model import build_demo_model

ARCHS = ["qwen3", "qwen2", "llama"]
PROMPT_LENS = [3, 7, 12, 20, 5, 33, 1, 17]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        name: (path := tmp_path_factory.mktemp(name), build_checkpoint(name, path, seed=i))
        for i, name in enumerate(ARCHS)
    }


@pytest.fixture(scope="module")
def tokenizer_dir():
    return str(build_demo_model("demo-tiny"))


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


def _check_against_hf(hf, prompts, outputs, captured) -> None:
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == MAX_TOKENS
        with torch.inference_mode():
            want = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
        got = torch.stack(captured[out.request_id])
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-4
        assert tokens == want.argmax(-1).tolist()


def _engine(path, tokenizer_dir, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 128)
    return LLM(model=str(path), tokenizer=tokenizer_dir, dtype="float32", **kwargs)


def _assert_pool_full(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_and_prefix_cache_hit(arch, checkpoints, tokenizer_dir) -> None:
    path, hf = checkpoints[arch]
    llm = _engine(path, tokenizer_dir, block_size=4)
    captured = capture_logits(llm)
    prompts = _prompts(seed=1)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _check_against_hf(hf, prompts, outputs, captured)
    _assert_pool_full(llm)

    # The same prompts again, plus extensions of them: every one must hit the prefix cache.
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    hits_before = kv.prefix_cache_stats.hits
    again = [p + [1, 2, 3] for p in prompts]
    captured.clear()
    outputs = llm.generate(again, GREEDY, use_tqdm=False)
    assert kv.prefix_cache_stats.hits - hits_before >= sum(len(p) // 4 * 4 for p in prompts) - 4
    assert sum(o.num_cached_tokens for o in outputs) > 0
    _check_against_hf(hf, again, outputs, captured)
    _assert_pool_full(llm)
    llm.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_preemption(arch, checkpoints, tokenizer_dir) -> None:
    path, hf = checkpoints[arch]
    # 16 tokens per step forces every prompt over 16 tokens into chunks; 14 blocks of 4 tokens
    # cannot hold the 8 requests' 146 tokens at once, so the scheduler must preempt.
    llm = _engine(
        path, tokenizer_dir, block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
        num_gpu_blocks_override=14, enable_prefix_caching=False, max_model_len=48,
    )
    captured = capture_logits(llm)
    prompts = _prompts(seed=2)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert max(PROMPT_LENS) > 16
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    _check_against_hf(hf, prompts, outputs, captured)
    _assert_pool_full(llm)
    llm.shutdown()


def test_triton_backend_matches_hf(checkpoints, tokenizer_dir) -> None:
    """The same oracle with the Triton attention kernels (interpreted on a CPU)."""
    path, hf = checkpoints["qwen3"]
    llm = _engine(path, tokenizer_dir, block_size=16, attention_backend="triton",
                  max_num_batched_tokens=16, max_num_seqs=4)
    model = llm.llm_engine.engine_core.model_executor.worker.model_runner.model
    assert model.attn_backend_cls.__name__ == "TritonAttentionBackend"
    captured = capture_logits(llm)
    prompts = _prompts(seed=3)[:3]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _check_against_hf(hf, prompts, outputs, captured)
    _assert_pool_full(llm)
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_equal_hf_log_softmax(
    checkpoints, tokenizer_dir, async_scheduling, monkeypatch
) -> None:
    """prompt_logprobs: each prompt token's logprob and rank under the tokens before it, and
    the top-k, equal transformers' log-softmax; with chunked prefill (16 tokens a step), in
    slices of 3 positions, a prefix-cache hit that must not skip the scores, and a batch
    mixing requests without."""
    from vllm.v1.worker import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "_PROMPT_LOGPROBS_ELEMENTS", 3 * TINY["vocab_size"])
    path, hf = checkpoints["qwen3"]
    llm = _engine(path, tokenizer_dir, block_size=4, max_num_batched_tokens=16,
                  async_scheduling=async_scheduling)
    prompts = _prompts(seed=3)
    llm.generate(prompts, GREEDY, use_tqdm=False)  # fills the prefix cache
    params = [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3 if i % 2 else 0)
              for i in range(len(prompts))]
    params[0] = GREEDY
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    hits_before = kv.prefix_cache_stats.hits
    outputs = llm.generate(prompts, params, use_tqdm=False)
    # Only the request without prompt_logprobs may use (and count) its prefix-cache hits.
    assert kv.prefix_cache_stats.hits - hits_before <= len(prompts[0])
    assert outputs[0].prompt_logprobs is None
    for prompt, p, out in list(zip(prompts, params, outputs))[1:]:
        with torch.inference_mode():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for j in range(1, len(prompt)):
            entry, token = got[j], prompt[j]
            row = want[j - 1]
            assert abs(entry[token].logprob - row[token].item()) < 1e-4
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = torch.topk(row, p.prompt_logprobs).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= p.prompt_logprobs + 1
    _assert_pool_full(llm)
    llm.shutdown()
