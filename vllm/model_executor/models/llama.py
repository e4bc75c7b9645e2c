"""Llama decoder-only transformer; Qwen2 and Qwen3 are small variations of it.

The model runs sharded: tensor parallelism splits attention heads, the MLP's intermediate
dimension and the vocabulary among the ranks of a stage (see layers/linear.py and
layers/vocab_embedding.py); pipeline parallelism gives each stage a contiguous run of decoder
layers, the embedding to the first stage and the final norm and LM head to the last.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata
from vllm.distributed.parallel_state import ParallelContext
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from vllm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.kv_scales import KVScaleLoader
from vllm.model_executor.model_loader.weight_utils import (
    CheckpointTensor,
    as_checkpoint_tensor,
    check_shape,
)

# Checkpoint tensors that land in a part of a fused parameter: (fused, checkpoint, part index).
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    (".qkv_proj.", ".q_proj.", 0),
    (".qkv_proj.", ".k_proj.", 1),
    (".qkv_proj.", ".v_proj.", 2),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)

# Checkpoint tensors outside the decoder layers that only the first or last stage holds.
_STAGE_EDGE_TENSORS = frozenset(
    {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
)
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")

# A hidden state with its residual stream, passed from one pipeline stage to the next.
Intermediate = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config: Any) -> int:
    """The per-head size: config.head_dim when set, else hidden_size / num_attention_heads."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    """Key/value heads (grouped-query attention); defaults to the number of query heads."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


class LlamaMLP(nn.Module):
    """Gated feed-forward block: down(silu(gate(x)) * up(x)), its intermediate dimension
    split among the tensor-parallel ranks."""

    def __init__(
        self,
        config: Any,
        bias: bool,
        parallel: ParallelContext,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: {act!r} is not supported (only 'silu')")
        # A shared expert or a dense layer of an MoE model has its own size.
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=bias, parallel=parallel
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, parallel=parallel)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [T, hidden] to [T, hidden] (all-reduced over the tensor-parallel group)."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention block: fused qkv projection, optional per-head q/k norm, RoPE, output.

    ``num_heads`` and ``num_kv_heads`` are this tensor-parallel rank's heads.
    """

    def __init__(
        self,
        config: Any,
        backend_cls: type[AttentionBackend],
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        parallel: ParallelContext,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        total_heads = config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_heads,
            num_kv_heads_of(config),
            bias=qkv_bias,
            parallel=parallel,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, bias=o_bias, parallel=parallel
        )
        eps = config.rms_norm_eps
        # Per-head norms act on each head alike, so every rank holds all of their weights.
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, rope_parameters(config)
        )
        # Holds no weights: a plain attribute, not a submodule.
        self.attn = backend_cls(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5
        )

    def _norm_heads(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        return norm(x.view(t, -1, self.head_dim)).view(t, -1)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Maps [T, hidden] to [T, hidden]. Side effect: writes this step's K/V of this
        rank's KV heads into kv_cache."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q = self._norm_heads(self.q_norm, q)
            k = self._norm_heads(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        t, d = q.shape[0], self.head_dim
        q = q.view(t, self.num_heads, d)
        k, v = k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        return self.o_proj(self.attn.forward(q, k, v, kv_cache, metadata).reshape(t, -1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block; carries the residual stream separately to fuse its adds.

    ``mlp`` maps [T, hidden] to [T, hidden] (a mixture of experts, say); by default a
    LlamaMLP.
    """

    def __init__(
        self,
        config: Any,
        attn: LlamaAttention,
        mlp_bias: bool,
        parallel: ParallelContext,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp if mlp is not None else LlamaMLP(config, mlp_bias, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output not yet added to the residual, residual stream)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class AbsentLayer(nn.Module):
    """Holds the place of a decoder layer that another pipeline stage runs, so the layers
    this stage does run keep their global index (and checkpoint names)."""

    def forward(self, *args: Any) -> None:
        """Always raises RuntimeError: this stage does not run the layer."""
        raise RuntimeError("this decoder layer belongs to another pipeline stage")


class LlamaModel(nn.Module):
    """Embedding (first stage), this stage's decoder layers and the final norm (last stage)."""

    def __init__(
        self,
        config: Any,
        make_layer: Callable[[int], LlamaDecoderLayer],
        parallel: ParallelContext,
    ) -> None:
        super().__init__()
        layout = parallel.layout
        self.stage = layout.stage_layers(config.num_hidden_layers)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if layout.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel
            )
        self.layers = nn.ModuleList(
            make_layer(i) if i in self.stage else AbsentLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm: RMSNorm | None = None
        if layout.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # EAGLE-3 (set_aux_layers): layer index -> slots of `aux_hidden` it fills.
        self._aux_slots: dict[int, list[int]] = {}
        self.aux_hidden: torch.Tensor | None = None

    def set_aux_layers(self, layer_ids: tuple[int, ...], max_tokens: int) -> None:
        """Makes every forward copy the residual stream entering each layer of `layer_ids`
        (len(layers): the last layer's output, before the final norm) into slot j of
        `aux_hidden` ([max_tokens, len(layer_ids) * hidden]: rows of the forward's tokens,
        slot j in columns j * hidden onwards). A fixed buffer, so a CUDA graph replays the
        copies too. Raises ValueError for a layer this stage does not run."""
        weight = self.layers[self.stage.start].input_layernorm.weight
        slots: dict[int, list[int]] = {}
        for j, layer in enumerate(layer_ids):
            if not (self.stage.start <= layer < self.stage.stop or layer == self.stage.stop):
                raise ValueError(f"auxiliary layer {layer} is not run by this stage")
            slots.setdefault(layer, []).append(j)
        self.aux_hidden = torch.zeros(max_tokens, len(layer_ids) * weight.shape[0],
                                      device=weight.device, dtype=weight.dtype)
        self._aux_slots = slots

    def _keep_aux(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        assert self.aux_hidden is not None
        stream = hidden if residual is None else hidden + residual
        width = stream.shape[1]
        for j in self._aux_slots[layer]:
            self.aux_hidden[: stream.shape[0], j * width : (j + 1) * width].copy_(stream)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: Intermediate | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | Intermediate:
        """Runs this stage's layers over [T] tokens at [T] positions.

        The first stage embeds input_ids, unless given their embeddings [T, hidden] as
        ``inputs_embeds`` (a multimodal model's, with images in them); a later stage starts
        from ``intermediate``, the previous stage's (hidden, residual). The last stage
        returns the final-normed hidden states [T, hidden]; another stage returns its
        (hidden, residual) for the next one. Raises ValueError when a later stage gets no
        intermediate.
        """
        residual: torch.Tensor | None
        if inputs_embeds is not None:
            hidden, residual = inputs_embeds, None
        elif self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        elif intermediate is None:
            raise ValueError("a pipeline stage after the first needs the previous (hidden, "
                             "residual) as intermediate")
        else:
            hidden, residual = intermediate
        aux = self._aux_slots
        for i, kv_cache in zip(self.stage, kv_caches, strict=True):
            if i in aux:
                self._keep_aux(i, hidden, residual)
            hidden, residual = self.layers[i](positions, hidden, residual, kv_cache, metadata)
        assert residual is not None  # every stage has at least one layer
        if self.stage.stop in aux:
            self._keep_aux(self.stage.stop, hidden, residual)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over flat varlen batches with a paged KV cache.

    Subclasses change the attention details through the class attributes below.
    Parameter names follow the Hugging Face checkpoint, except q/k/v and gate/up, which are
    fused (see STACKED_PARAMS). Under a ParallelContext the module holds only this rank's
    part: its stage's layers (``num_layers`` of them) and its tensor-parallel shards
    (``num_kv_heads`` is this rank's KV heads); ``vocab_size`` and ``hidden_size`` are the
    model's.
    """

    # Per-head RMSNorm on queries and keys before RoPE (Qwen3).
    qk_norm: bool = False
    # (module-name fragment, checkpoint-name fragment) pairs for families whose checkpoint
    # names a module differently from this class (Mixtral's MoE block).
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # Whether a decode step can be captured in a CUDA graph (no host syncs in forward).
    supports_cuda_graphs: bool = True

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        """Whether the qkv and output projections have a bias."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(
        self,
        hf_config: Any,
        attn_backend_cls: type[AttentionBackend],
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.attn_backend_cls = attn_backend_cls
        self.parallel = parallel or ParallelContext.single()
        self.head_dim: int = head_dim_of(hf_config)
        self.vocab_size: int = hf_config.vocab_size
        self.hidden_size: int = hf_config.hidden_size
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Whether the checkpoint gave the FP8 KV cache its per-layer scales (load_weights).
        self.kv_scales_from_checkpoint = False
        self.model = LlamaModel(hf_config, self._make_layer, self.parallel)
        self.num_layers: int = len(self.model.stage)
        first_layer = self.model.layers[self.model.stage.start]
        self.num_kv_heads: int = first_layer.self_attn.num_kv_heads
        self.lm_head: ParallelLMHead | None = None
        if self.parallel.layout.is_last_stage:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                          self.parallel)
            if self.tied and self.model.embed_tokens is not None:
                self.lm_head.tie(self.model.embed_tokens)

    def _make_layer(self, index: int) -> LlamaDecoderLayer:
        config = self.config
        qkv_bias, o_bias = self.attention_biases(config)
        attn = LlamaAttention(
            config, self.attn_backend_cls, qkv_bias, o_bias, self.qk_norm, self.parallel
        )
        return LlamaDecoderLayer(
            config, attn, bool(getattr(config, "mlp_bias", False)), self.parallel,
            self._make_mlp(index),
        )

    def _make_mlp(self, index: int) -> nn.Module | None:
        """The feed-forward block of decoder layer ``index``; None: the dense LlamaMLP."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate: Intermediate | None = None,
    ) -> torch.Tensor | Intermediate:
        """Runs this rank's stage over [T] tokens at [T] positions (see LlamaModel.forward).

        Returns final hidden states [T, hidden_size] on the last stage, else the
        (hidden, residual) pair the next stage takes as ``intermediate``.
        Side effect: writes each local layer's K/V for these tokens into kv_caches (one per
        layer of this stage).
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Maps hidden states [N, hidden_size] to float32 logits [N, vocab_size] (the full
        vocabulary on every tensor-parallel rank), written into `out` where the LM head can
        (ParallelLMHead.forward). Raises RuntimeError off the last stage."""
        if self.lm_head is None:
            raise RuntimeError("compute_logits: only the last pipeline stage has the LM head")
        return self.lm_head(hidden, out)

    def weight_aliases(self) -> dict[str, str]:
        """Parameters that take their values from a checkpoint tensor of another name.

        A tied LM head on a last stage that has no embedding loads the embedding's matrix.
        """
        if self.tied and self.lm_head is not None and self.model.embed_tokens is None:
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    def _checkpoint_targets(self) -> dict[str, tuple[str, str, int | None]]:
        """Checkpoint name -> (module name, parameter name, fused part or None) on this rank."""
        aliases = self.weight_aliases()
        targets: dict[str, tuple[str, str, int | None]] = {}
        for name, _ in self.named_parameters():
            module_name, param_name = name.rsplit(".", 1)
            parts = getattr(self.get_submodule(module_name), "checkpoint_parts", None)
            if parts is not None:
                # A module that stacks many checkpoint tensors (the experts) lists them.
                for suffix, index in parts(param_name):
                    ckpt_name = self.checkpoint_name(f"{module_name}.{suffix}")
                    targets[ckpt_name] = (module_name, param_name, index)
                continue
            stacked = [(f, c, i) for f, c, i in STACKED_PARAMS if f in name]
            for fused, ckpt, index in stacked:
                targets[self.checkpoint_name(name.replace(fused, ckpt))] = (
                    module_name, param_name, index
                )
            if not stacked:
                targets[self.checkpoint_name(aliases.get(name, name))] = (
                    module_name, param_name, None
                )
        return targets

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's spelling of one of this module's (dotted) names."""
        for ours, theirs in self.checkpoint_renames:
            name = name.replace(ours, theirs)
        return name

    def _held_elsewhere(self, name: str) -> bool:
        """Whether a checkpoint tensor this rank lacks belongs to another pipeline stage."""
        match = _LAYER_TENSOR.match(name)
        if match:
            index = int(match.group(1))
            return index < self.config.num_hidden_layers and index not in self.model.stage
        return name in _STAGE_EDGE_TENSORS

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]
    ) -> None:
        """Copies checkpoint tensors (Hugging Face names) into this rank's parameters.

        Takes plain tensors or lazy CheckpointTensor handles; of each, only the slice this
        rank keeps is read. Tensors of other pipeline stages are skipped.
        KV-cache scales (kv_scales.py) go to the attention layers.
        Side effect: overwrites parameters in place (cast to their dtype and device).
        Raises ValueError naming a tensor that is missing (for this rank), unknown, or has
        the wrong shape.
        """
        targets = self._checkpoint_targets()
        kv_scales = KVScaleLoader(
            {i: self.model.layers[i].self_attn.attn for i in self.model.stage},
            self.config.num_hidden_layers,
        )
        loaded: set[str] = set()
        for name, value in weights:
            if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight"):
                continue  # recomputed, or shared with the embedding
            if kv_scales.take(name, as_checkpoint_tensor(value)):
                continue
            target = targets.get(name)
            if target is None:
                if self._held_elsewhere(name):
                    continue
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            try:
                self._load_one(target, as_checkpoint_tensor(value))
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"checkpoint is missing tensor {missing[0]!r}{more}")
        self.kv_scales_from_checkpoint = kv_scales.finish()

    def _load_one(self, target: tuple[str, str, int | None], tensor: CheckpointTensor) -> None:
        module_name, param_name, part = target
        module = self.get_submodule(module_name)
        load = getattr(module, "load_weight", None)
        if load is not None:
            load(param_name, tensor, part)
            return
        # Replicated parameters (norms) are copied whole.
        param = getattr(module, param_name)
        check_shape(tensor, tuple(param.shape))
        with torch.no_grad():
            param.data.copy_(tensor.read())
