"""The EAGLE-3 draft head: a few decoder layers that guess the target's next tokens from its
hidden states (docs/architecture.md §11).

At position p the head reads the token at p + 1 and a hidden state for p: for positions the
target computed, `fc` over the target's auxiliary hidden states (the residual stream entering
the layers `aux_layer_ids`, concatenated); for a drafted position, the head's own output at
the position before. Its first layer attends over [norm(token embedding) ; norm(hidden)]
(q/k/v take 2 x hidden inputs) and adds the attention to the hidden state (not to the
embedding); later layers are plain pre-norm decoder layers. The final norm and LM head give
logits over the draft vocabulary, whose id d is the target's `d2t_ids[d]`. Attention runs on
the engine's backends over a paged KV cache of the head's own (one tensor per layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.attention.backends.abstract import AttentionBackend, AttentionMetadata
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.transformers_utils.eagle3_config import Eagle3HeadConfig
from vllm.transformers_utils.eagle3_weights import read_tensor


class _Attention(nn.Module):
    """Grouped-query self-attention with RoPE (and Qwen3's per-head q/k norms)."""

    def __init__(self, config: Eagle3HeadConfig, in_width: int,
                 backend_cls: type[AttentionBackend], max_position: int) -> None:
        super().__init__()
        c, bias = config, config.attention_bias
        self.head_dim, self.num_heads, self.num_kv_heads = c.head_dim, c.num_heads, c.num_kv_heads
        self.q_proj = nn.Linear(in_width, c.num_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_width, c.num_kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_width, c.num_kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.rotary_emb = RotaryEmbedding(c.head_dim, max_position, c.rope)
        # Holds no weights: a plain attribute, not a submodule.
        self.attn = backend_cls(c.num_heads, c.head_dim, c.num_kv_heads, c.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """[T, in_width] -> [T, hidden]. Side effect: writes the tokens' K/V into kv_cache."""
        t, d = x.shape[0], self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.view(t, -1, d)).view(t, -1)
            k = self.k_norm(k.view(t, -1, d)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn.forward(q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d),
                                v.view(t, self.num_kv_heads, d), kv_cache, metadata)
        return self.o_proj(out.reshape(t, -1))


class _Layer(nn.Module):
    """One decoder layer of the head; the first one also reads the token embedding."""

    def __init__(self, config: Eagle3HeadConfig, index: int,
                 backend_cls: type[AttentionBackend], max_position: int) -> None:
        super().__init__()
        h, eps, bias = config.hidden_size, config.rms_norm_eps, config.mlp_bias
        self.first = index == 0
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps) if self.first else None
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attn = _Attention(config, 2 * h if self.first else h, backend_cls,
                                    max_position)
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(h, config.intermediate_size, bias=bias),
            "up_proj": nn.Linear(h, config.intermediate_size, bias=bias),
            "down_proj": nn.Linear(config.intermediate_size, h, bias=bias),
        })

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Returns the residual stream after the layer ([T, hidden])."""
        if self.hidden_norm is not None:
            normed = self.hidden_norm(hidden)
            # The attention is added to the hidden state (normed first if so trained).
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual, x = hidden, self.input_layernorm(hidden)
        hidden = residual + self.self_attn(positions, x, kv_cache, metadata)
        x = self.post_attention_layernorm(hidden)
        mlp = self.mlp
        return hidden + mlp["down_proj"](F.silu(mlp["gate_proj"](x)) * mlp["up_proj"](x))


class Eagle3Head(nn.Module):
    """An EAGLE-3 head for one target (see the module docstring).

    `target_embedding` embeds token ids when the checkpoint has no embedding of its own (a
    module of the target: shared, not copied). `max_position` bounds the positions it runs
    at (the target's max_model_len).
    """

    def __init__(self, config: Eagle3HeadConfig, backend_cls: type[AttentionBackend],
                 max_position: int, target_embedding: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        self.attn_backend_cls = backend_cls
        h, n_aux, eps = config.hidden_size, len(config.aux_layer_ids), config.rms_norm_eps
        self.hidden_size = h
        self.num_layers = config.num_layers
        self.num_kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        self.input_norm = RMSNorm(n_aux * h, eps) if config.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(h, eps) for _ in range(n_aux))
                        if config.fc_norm else None)
        self.fc = nn.Linear(n_aux * h, h, bias=False)
        self.layers = nn.ModuleList(_Layer(config, i, backend_cls, max_position)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        if config.has_embedding:
            self.embed_tokens: nn.Module | None = nn.Embedding(config.vocab_size, h)
            self._shared_embedding: list[nn.Module] = []
        else:
            if target_embedding is None:
                raise ValueError("--speculative-config.model: the head has no embed_tokens and "
                                 "no target embedding was given to share")
            self.embed_tokens = None
            # In a list: a registered submodule would count (and move) the target's weights.
            self._shared_embedding = [target_embedding]
        self.register_buffer("d2t_ids", torch.zeros(config.draft_vocab_size, dtype=torch.int64),
                             persistent=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] (the target's when the head has none)."""
        module = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding[0]
        return module(token_ids)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The hidden state the head reads for target positions: fc over the concatenated
        auxiliary hidden states [T, n_aux * hidden] (normed first where so trained)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            parts = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(aux)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        """Runs the layers over [T] tokens (each the token after its position) with their
        hidden states [T, hidden]; returns the final residual stream [T, hidden]. Side effect:
        writes each layer's K/V into kv_caches at metadata.slot_mapping."""
        embeds = self.embed(token_ids).to(hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, embeds, hidden, kv_cache, metadata)
        return hidden

    def carry(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden state the next drafted position reads (the final norm's input, or its
        output for heads trained with norm_output)."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary [N, draft_vocab_size]."""
        return self.lm_head(self.norm(hidden)).float()

    def load_weights(self) -> None:
        """Copies the checkpoint's tensors into the parameters (cast to their dtype and
        device) and fills d2t_ids. Raises ValueError naming a tensor that cannot be read."""
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, ref in self.config.tensors.items():
                if name in ("d2t", "t2d"):
                    continue
                params[name].copy_(read_tensor(ref))
            self.d2t_ids.copy_(self.config.draft_to_target())
