"""Llama decoder-only transformer; Qwen2 and Qwen3 are small variations of it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import Linear, MergedLinear
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from vllm.model_executor.layers.vocab_embedding import LMHead, VocabEmbedding

# Checkpoint tensors that land in a part of a fused parameter: (fused, checkpoint, part index).
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    (".qkv_proj.", ".q_proj.", 0),
    (".qkv_proj.", ".k_proj.", 1),
    (".qkv_proj.", ".v_proj.", 2),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


def head_dim_of(config: Any) -> int:
    """The per-head size: config.head_dim when set, else hidden_size / num_attention_heads."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    """Key/value heads (grouped-query attention); defaults to the number of query heads."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


class LlamaMLP(nn.Module):
    """Gated feed-forward block: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: Any, bias: bool) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: {act!r} is not supported (only 'silu')")
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=bias)
        self.down_proj = Linear(size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps [T, hidden] to [T, hidden]."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention block: fused qkv projection, optional per-head q/k norm, RoPE, output."""

    def __init__(
        self,
        config: Any,
        backend_cls: type[AttentionBackend],
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = num_kv_heads_of(config)
        self.head_dim = head_dim_of(config)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, rope_parameters(config)
        )
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, backend_cls
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
        """Maps [T, hidden] to [T, hidden]. Side effect: writes this step's K/V into kv_cache."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q = self._norm_heads(self.q_norm, q)
            k = self._norm_heads(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block; carries the residual stream separately to fuse its adds."""

    def __init__(self, config: Any, attn: LlamaAttention, mlp_bias: bool) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = LlamaMLP(config, mlp_bias)
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


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: Any, layers: list[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Maps [T] token ids at [T] positions to final hidden states [T, hidden]."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over flat varlen batches with a paged KV cache.

    Subclasses change the attention details through the class attributes below.
    Parameter names follow the Hugging Face checkpoint, except q/k/v and gate/up, which are
    fused (see STACKED_PARAMS).
    """

    # Per-head RMSNorm on queries and keys before RoPE (Qwen3).
    qk_norm: bool = False

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        """Whether the qkv and output projections have a bias."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(self, hf_config: Any, attn_backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = hf_config
        self.attn_backend_cls = attn_backend_cls
        self.num_layers: int = hf_config.num_hidden_layers
        self.num_kv_heads: int = num_kv_heads_of(hf_config)
        self.head_dim: int = head_dim_of(hf_config)
        self.vocab_size: int = hf_config.vocab_size
        self.hidden_size: int = hf_config.hidden_size
        qkv_bias, o_bias = self.attention_biases(hf_config)
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        layers = [
            LlamaDecoderLayer(
                hf_config,
                LlamaAttention(hf_config, attn_backend_cls, qkv_bias, o_bias, self.qk_norm),
                mlp_bias,
            )
            for _ in range(self.num_layers)
        ]
        self.model = LlamaModel(hf_config, layers)
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns final hidden states [T, hidden_size] for [T] tokens at [T] positions.

        Side effect: writes every layer's K/V for these tokens into kv_caches (one per layer).
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Maps hidden states [N, hidden_size] to float32 logits [N, vocab_size]."""
        return self.lm_head(hidden)

    def checkpoint_names(self) -> set[str]:
        """Names of the checkpoint tensors this model needs."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            parts = [(fused, ckpt) for fused, ckpt, _ in STACKED_PARAMS if fused in name]
            if not parts:
                names.add(name)
            names.update(name.replace(fused, ckpt) for fused, ckpt in parts)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (Hugging Face names) into the parameters.

        Side effect: overwrites parameters in place (cast to their dtype and device).
        Raises ValueError naming a tensor that is missing, unknown, or has the wrong shape.
        """
        params = dict(self.named_parameters())
        needed = self.checkpoint_names()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight"):
                continue  # recomputed, or shared with the embedding
            if name not in needed:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            try:
                self._load_one(params, name, tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
            loaded.add(name)
        missing = sorted(needed - loaded)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"checkpoint is missing tensor {missing[0]!r}{more}")

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            for fused, part, index in STACKED_PARAMS:
                if part in name:
                    module_name, param_name = name.replace(part, fused).rsplit(".", 1)
                    layer = self.get_submodule(module_name)
                    assert isinstance(layer, MergedLinear)
                    layer.load_shard(param_name, index, tensor)
                    return
            param = params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"shape {tuple(tensor.shape)} does not match expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
