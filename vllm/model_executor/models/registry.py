"""Maps Hugging Face architecture names to model classes."""

from __future__ import annotations

from torch import nn


def _classes() -> dict[str, type[nn.Module]]:
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.mixtral import MixtralForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration

    return {
        "LlamaForCausalLM": LlamaForCausalLM,
        # Mistral's decoder is Llama's (a sliding_window is checked by ModelConfig).
        "MistralForCausalLM": LlamaForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
        "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    }


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """Returns the class for the first supported name in a config's ``architectures``.

    Raises ValueError naming the given architectures when none is supported.
    """
    classes = _classes()
    for arch in architectures or []:
        if arch in classes:
            return classes[arch]
    raise ValueError(
        f"architectures: {list(architectures or [])} not supported; "
        f"supported: {', '.join(sorted(classes))}"
    )
