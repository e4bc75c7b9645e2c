"""Multimodal settings: how many images a prompt may carry, how many image embeddings the
runner keeps, and how a vision-language config is read.

A vision-language config (Qwen2.5-VL's) nests the language model under `text_config`.
The engine reads the language model's fields (vocabulary, layers, heads) from
`ModelConfig.hf_config` wherever it runs, so `flatten_vl_config` makes that config the text
config, carrying the vision config and the image token ids beside its own fields.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

# Upstream's default per-modality limit (effectively none: the context bounds a prompt).
DEFAULT_LIMIT_PER_PROMPT = 999
# Modalities a prompt may carry here.
MODALITIES = ("image",)
# Fields of a vision-language config that the flattened config keeps from the outer one.
_OUTER_FIELDS = ("architectures", "vision_config", "image_token_id", "video_token_id",
                 "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings",
                 "quantization_config")


def is_vl_config(config: Any) -> bool:
    """Whether a transformers config describes a vision-language model (vision and text
    parts)."""
    return (getattr(config, "vision_config", None) is not None
            and getattr(config, "text_config", None) is not None)


def flatten_vl_config(config: Any) -> Any:
    """The config the engine runs a model with: a vision-language config becomes a copy of
    its text config carrying `_OUTER_FIELDS` of the outer one; anything else is returned
    as is."""
    if not is_vl_config(config):
        return config
    text = copy.deepcopy(config.text_config)
    for name in _OUTER_FIELDS:
        value = getattr(config, name, None)
        if value is not None:
            setattr(text, name, value)
    return text


def is_vl_config_flat(config: Any) -> bool:
    """Whether an engine's (flattened) model config is a vision-language model's."""
    return getattr(config, "vision_config", None) is not None


def check_limit_per_prompt(limits: object) -> dict[str, int]:
    """--limit-mm-per-prompt as {modality: most items per prompt}: a JSON object whose keys
    are among MODALITIES and whose values are non-negative integers. Raises ValueError
    naming the flag otherwise."""
    flag = "--limit-mm-per-prompt"
    if limits is None:
        return {}
    if not isinstance(limits, dict):
        raise ValueError(f"{flag}: must be a JSON object such as '{{\"image\": 2}}', got "
                         f"{limits!r}")
    for key, value in limits.items():
        if key not in MODALITIES:
            raise ValueError(f"{flag}: {key!r} is not supported here (only "
                             f"{', '.join(MODALITIES)})")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{flag}.{key}: must be a non-negative integer, got {value!r}")
    return dict(limits)


@dataclass
class MultiModalConfig:
    """Limits of multimodal requests (used only with a vision-language model)."""

    # --limit-mm-per-prompt: most items of each modality in one prompt.
    limit_per_prompt: dict[str, int] = field(default_factory=dict)
    # --encoder-cache-size: image embeddings (rows, one per placeholder token) the runner
    # keeps for reuse once no running prefill needs them; None: max_num_batched_tokens.
    encoder_cache_size: int | None = None
    # --allowed-local-media-path: the directory under which file:// image URLs may be read
    # (None: none may).
    allowed_local_media_path: str | None = None
    # --allowed-media-domains: host names whose http(s) image URLs may be fetched (None or
    # empty: none may).
    allowed_media_domains: list[str] | None = None
    # --mm-processor-kwargs: the image processor's pixel bounds over the model's own
    # (multimodal/processor_kwargs.py); normalized to {"min_pixels", "max_pixels"}.
    mm_processor_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Imported here: the processor modules import this one.
        from vllm.multimodal.processor_kwargs import check_processor_kwargs

        self.limit_per_prompt = check_limit_per_prompt(self.limit_per_prompt)
        self.mm_processor_kwargs = check_processor_kwargs(self.mm_processor_kwargs,
                                                          "--mm-processor-kwargs")
        if self.encoder_cache_size is not None and self.encoder_cache_size < 0:
            raise ValueError(f"--encoder-cache-size: must be >= 0, got "
                             f"{self.encoder_cache_size}")

    def verify(self, vllm_config: Any) -> None:
        """Refuses, naming the flag, what a vision-language model does not run with yet:
        drafts from a model (a draft model or an EAGLE-3 head reads only text, and would
        need the images' embeddings and M-RoPE positions); and --mm-processor-kwargs on a
        text-only model."""
        if not is_vl_config_flat(vllm_config.model_config.hf_config):
            if self.mm_processor_kwargs:
                raise ValueError("--mm-processor-kwargs: the model is not a vision-language "
                                 "model (it has no image processor)")
            return
        spec = vllm_config.speculative_config
        if spec is not None and spec.method not in ("ngram", "grammar"):
            raise ValueError(f"--speculative-config.method: {spec.method!r} drafts with a "
                             "text-only model, which a vision-language model does not run "
                             "with yet; 'ngram' and 'grammar' (fast-forward) do")

    def limit(self, modality: str) -> int:
        """Most items of `modality` one prompt may carry."""
        return self.limit_per_prompt.get(modality, DEFAULT_LIMIT_PER_PROMPT)
