"""Qwen2: Llama with a bias on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM: biased q/k/v projections, unbiased output projection."""

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        """Qwen2 always has qkv bias and never an output-projection bias."""
        return True, False
