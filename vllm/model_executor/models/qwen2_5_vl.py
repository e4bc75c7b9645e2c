"""Qwen2.5-VL: the Qwen2 language model with M-RoPE, fed image embeddings from its vision
tower (qwen2_5_vl_vision.py) at the image placeholder positions.

The runner hands the model a step's multimodal inputs (`MultiModalStep`): the image
embeddings of the placeholder positions this step computes and the three M-RoPE positions
of every token. A step without them (only text requests) runs as Qwen2 does, M-RoPE on
equal positions being plain RoPE. Under pipeline parallelism every stage takes the M-RoPE
positions; only the stages that use image rows (the first; with DeepStack, also those
running its layers) hold the vision tower and get the rows. Checkpoints come in two layouts, both read: the one
transformers writes (`visual.*`, `model.*`, `lm_head.*`) and the newer nested one
(`model.visual.*`, `model.language_model.*`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata
from vllm.distributed.parallel_state import ParallelContext
from vllm.model_executor.layers.mrope import MRotaryEmbedding
from vllm.model_executor.layers.rotary_embedding import rope_parameters
from vllm.model_executor.model_loader.weight_utils import (
    CheckpointTensor,
    as_checkpoint_tensor,
    check_shape,
)
from vllm.model_executor.models.llama import Intermediate
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer

# Checkpoint name prefixes of the nested layout, mapped to the flat one.
_NESTED_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "model."))


@dataclass
class MultiModalStep:
    """A step's multimodal inputs, on the model's device."""

    # [3, T] int64: temporal, height and width position of every token of the step.
    mrope_positions: torch.Tensor
    # [K] int64: the step's token rows that take an image embedding instead of their
    # token's, and [K, hidden] those embeddings (K may be 0).
    embed_rows: torch.Tensor
    embeds: torch.Tensor


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2.5-VL over flat varlen batches with a paged KV cache (tensor parallel: the
    vision tower is replicated on every rank; pipeline parallel: on the stages that use
    image rows)."""

    # Per-step positions are built on the host from each request's images.
    supports_cuda_graphs = False
    # The runner gives it a MultiModalStep (vllm/v1/worker/mm_step.py).
    is_multimodal = True
    # Qwen3-VL's layout of the M-RoPE frequencies (layers/mrope.py) and its name in errors.
    mrope_interleaved: bool = False
    family: str = "Qwen2.5-VL"
    # The M-RoPE sections when the config names none (None: it must name them).
    default_mrope_section: tuple[int, int, int] | None = None

    @staticmethod
    def num_deepstack_layers(vision_config: Any) -> int:
        """How many of the first decoder layers take an extra image embedding after them
        (Qwen3-VL's DeepStack; none here)."""
        return 0

    def __init__(
        self,
        hf_config: Any,
        attn_backend_cls: type[AttentionBackend],
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__(hf_config, attn_backend_cls, parallel)
        params = rope_parameters(hf_config)
        section = params.get("mrope_section") or self.default_mrope_section
        if section is None:
            raise ValueError("rope_parameters.mrope_section: missing from the text config "
                             f"of a {self.family} model")
        for i in self.model.stage:
            attn = self.model.layers[i].self_attn
            attn.rotary_emb = MRotaryEmbedding(
                self.head_dim, hf_config.max_position_embeddings, params, list(section),
                self.mrope_interleaved,
            )
        deepstack = self.num_deepstack_layers(hf_config.vision_config)
        # Only a stage that uses image rows holds the tower (the runner then encodes there).
        uses_images = (self.parallel.layout.is_first_stage
                       or any(i < deepstack for i in self.model.stage))
        self.visual = self.make_vision_tower(hf_config.vision_config) if uses_images else None
        self.image_token_id: int = hf_config.image_token_id

    def make_vision_tower(self, vision_config: Any) -> torch.nn.Module:
        """The family's vision tower (its parameters load from the checkpoint's visual.*)."""
        return Qwen2_5_VisionTransformer(vision_config)

    def embed_image(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """The language-model embeddings of one image's placeholder tokens:
        [t * h * w / merge**2, hidden_size], in the model's dtype. Only on a stage with the
        tower (RuntimeError otherwise)."""
        if self.visual is None:
            raise RuntimeError("this pipeline stage has no vision tower")
        return self.visual(pixels, grid_thw).to(self.model.layers[self.model.stage.start]
                                                .input_layernorm.weight.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate: Intermediate | None = None,
        mm: MultiModalStep | None = None,
    ) -> torch.Tensor | Intermediate:
        """As Qwen2's forward (this stage's layers; see LlamaModel.forward); with `mm`, the
        M-RoPE positions replace `positions`, and on the first stage the image rows' main
        embeddings (their first hidden_size columns) replace their token embeddings. Any
        further columns are DeepStack embeddings: the i-th is added to those rows after
        decoder layer i."""
        if mm is None:
            return super().forward(input_ids, positions, kv_caches, attn_metadata, intermediate)
        model = self.model
        rows, width = mm.embed_rows, self.hidden_size
        deepstack: list[torch.Tensor] = []
        if rows.numel() and mm.embeds.shape[1] > width:
            deepstack = list(mm.embeds[:, width:].split(width, dim=1))
        residual: torch.Tensor | None = None
        if model.embed_tokens is not None:
            hidden = model.embed_tokens(input_ids)
            if rows.numel():
                hidden = hidden.index_copy(0, rows, mm.embeds[:, :width].to(hidden.dtype))
        elif intermediate is None:
            raise ValueError("a pipeline stage after the first needs the previous (hidden, "
                             "residual) as intermediate")
        else:
            hidden, residual = intermediate
        for i, kv_cache in zip(model.stage, kv_caches, strict=True):
            hidden, residual = model.layers[i](mm.mrope_positions, hidden, residual, kv_cache,
                                               attn_metadata)
            if i < len(deepstack):
                # The stream is hidden + residual: adding to either adds to the stream.
                hidden = hidden.index_add(0, rows, deepstack[i].to(hidden.dtype))
        assert residual is not None  # every stage has at least one layer
        if model.norm is None:
            return hidden, residual
        hidden, _ = model.norm(hidden, residual)
        return hidden

    def _checkpoint_targets(self) -> dict[str, tuple[str, str, int | None]]:
        # The vision tower loads apart (load_weights), never through the text machinery.
        return {name: target for name, target in super()._checkpoint_targets().items()
                if not name.startswith("visual.")}

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]
    ) -> None:
        """Loads the language model as Qwen2 does and the vision tower whole on every rank.
        Raises ValueError naming a vision tensor that is missing, unknown or misshapen (and
        what Qwen2's loader raises for the rest)."""
        vision = dict(self.visual.named_parameters()) if self.visual is not None else {}
        loaded: set[str] = set()

        def text_weights() -> Iterator[tuple[str, torch.Tensor | CheckpointTensor]]:
            for name, value in weights:
                for nested, flat in _NESTED_PREFIXES:
                    if name.startswith(nested):
                        name = flat + name[len(nested):]
                        break
                if not name.startswith("visual."):
                    yield name, value
                    continue
                if self.visual is None:
                    continue  # a later pipeline stage without the tower
                local = name[len("visual."):]
                param = vision.get(local)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                     f"{type(self).__name__}")
                tensor = as_checkpoint_tensor(value)
                try:
                    check_shape(tensor, tuple(param.shape))
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
                with torch.no_grad():
                    param.data.copy_(tensor.read())
                loaded.add(local)

        super().load_weights(text_weights())
        missing = sorted(set(vision) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensor 'visual.{missing[0]}'"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
