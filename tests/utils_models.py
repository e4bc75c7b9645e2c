"""Random tiny Hugging Face checkpoints shared by model and engine tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


# Mixture-of-experts fields shared by the tiny MoE configs: 8 (Qwen) or 4 (Mixtral)
# experts of intermediate size 32, two per token.
TINY_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)


def hf_config(name: str):
    """A tiny transformers config for 'qwen3', 'qwen2', 'llama', 'llama3_rope', 'mistral',
    'qwen3_moe', 'qwen2_moe' or 'mixtral'."""
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if name == "qwen3":
        # head_dim * heads != hidden_size on purpose.
        return Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True,
                           architectures=["Qwen3ForCausalLM"])
    if name == "qwen2":
        return Qwen2Config(**TINY, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    if name == "llama":
        return LlamaConfig(**TINY, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    if name == "llama3_rope":
        return LlamaConfig(**TINY, tie_word_embeddings=True, rope_scaling=dict(LLAMA3_ROPE),
                           architectures=["LlamaForCausalLM"])
    if name == "mistral":
        # head_dim * heads != hidden_size, as Mistral NeMo's; a sliding window of 64 positions
        # (ModelConfig then serves at most 64 tokens, where full attention is the same).
        return MistralConfig(**TINY, head_dim=32, sliding_window=64, tie_word_embeddings=False,
                             architectures=["MistralForCausalLM"])
    if name == "qwen3_moe":
        # Three layers, the middle one dense (mlp_only_layers); renormalised top-k weights.
        fields = {**TINY, "num_hidden_layers": 3}
        return Qwen3MoeConfig(**fields, **TINY_MOE, num_experts=8, head_dim=32,
                              norm_topk_prob=True, mlp_only_layers=[1],
                              tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    if name == "qwen2_moe":
        # decoder_sparse_step 2: layer 0 dense, layer 1 sparse; top-k weights as routed.
        return Qwen2MoeConfig(**TINY, **TINY_MOE, num_experts=8, decoder_sparse_step=2,
                              shared_expert_intermediate_size=48, norm_topk_prob=False,
                              tie_word_embeddings=False, architectures=["Qwen2MoeForCausalLM"])
    if name == "mixtral":
        fields = {**TINY, "intermediate_size": 32}
        return MixtralConfig(**fields, num_local_experts=4, num_experts_per_tok=2,
                             tie_word_embeddings=False, architectures=["MixtralForCausalLM"])
    raise AssertionError(name)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order-one activations, so a 1e-4 logit tolerance is meaningful."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                # Fan-in is the last dimension, also of stacked [E, out, in] expert weights.
                p.copy_(noise / p.shape[-1] ** 0.5)


def build_checkpoint(name: str, path: Path, seed: int):
    """Saves a random tiny checkpoint of architecture `name` to path; returns the HF model."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(
        hf_config(name), attn_implementation="eager", dtype=torch.float32
    )
    randomize(hf, seed)
    hf.eval()
    hf.save_pretrained(path)
    return hf


def capture_logits(llm) -> dict[str, list[torch.Tensor]]:
    """Records, per engine request id, the logits row of every sampled token of `llm` (an
    in-process LLM). Side effect: wraps its model runner's sample_tokens."""
    runner = llm.llm_engine.engine_core.model_executor.worker.model_runner
    captured: dict[str, list[torch.Tensor]] = {}
    original = runner.sample_tokens

    def sample_tokens(grammar_output):
        step = runner._steps[0] if runner._steps else None  # the oldest unsampled step
        if step is not None and step.logits is not None:
            for i, req_id in enumerate(step.sampled_req_ids):
                # A copy: on the CPU the runner reuses logits memory for later steps.
                captured.setdefault(req_id, []).append(step.logits[i].float().cpu().clone())
        return original(grammar_output)

    runner.sample_tokens = sample_tokens
    return captured
