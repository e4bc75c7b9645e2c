"""Qwen3: Llama with per-head RMSNorm on queries and keys."""

from __future__ import annotations

from vllm.model_executor.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM: q_norm/k_norm over each head before RoPE; biases per attention_bias."""

    qk_norm = True
