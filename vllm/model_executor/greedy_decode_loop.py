"""A bare greedy decode loop over a checkpoint: the ceiling the engine is measured against,
and the draft model of speculative decoding (docs/architecture.md §11).

No scheduler, no paging, no sampler, no detokenizer: the embedding, each decoder layer with a
contiguous KV cache and `scaled_dot_product_attention`, the final norm, the LM head and an
argmax, for a whole batch at once. To be an honest ceiling it uses the fastest primitives the
engine has: decode steps read the cache through views (no copy), CPU weights are stored
column-major as the engine stores them, the CPU LM head writes into one reused buffer, and the
CPU argmax is the engine's one-pass kernel. Prompts of equal length are prefilled together,
then every step decodes one token of every sequence. Whatever the engine spends beyond this
loop is its own overhead (docs/architecture.md §9). Qwen3, Qwen2 and Llama checkpoints
without RoPE scaling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from vllm import _custom_ops as ops
from vllm.model_executor.layers import batch_invariant_linear, layer_ops
from vllm.model_executor.layers.column_major import column_major
from vllm.model_executor.layers.huge_pages import WeightArena
from vllm.model_executor.model_loader.gguf_loader import iterate_gguf
from vllm.transformers_utils.gguf_dir import find_gguf


class BareDecoder:
    """The checkpoint in `model_dir` as plain tensors, with a batched greedy `generate`."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        """Loads config.json and the safetensors weights (or the GGUF file of a converted
        GGUF directory). Raises ValueError for an architecture or RoPE scaling this loop does
        not implement."""
        root = Path(model_dir)
        config = json.loads((root / "config.json").read_text())
        arch = (config.get("architectures") or ["?"])[0]
        if arch not in ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"):
            raise ValueError(f"bare decode loop: architecture {arch} is not supported")
        # Older configs keep RoPE settings in rope_theta / rope_scaling, newer ones in
        # rope_parameters.
        rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError("bare decode loop: RoPE scaling is not supported")
        theta = rope.get("rope_theta") or config.get("rope_theta") or 10000.0
        self.vocab_size = config["vocab_size"]
        self.num_layers = config["num_hidden_layers"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads", self.num_heads)
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.num_heads
        self.eps = config["rms_norm_eps"]
        self.qk_norm = arch == "Qwen3ForCausalLM"
        weights: dict[str, torch.Tensor] = {}
        gguf_file = find_gguf(root)
        if gguf_file is not None:  # the engine's own GGUF reading (dequantized float32)
            shape = SimpleNamespace(**config)
            weights = {name: t.read() for name, t in iterate_gguf(gguf_file, shape)}
        for path in sorted(root.glob("*.safetensors")):
            weights.update(load_file(str(path)))
        self.w = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}
        # Fused q/k/v and gate/up products, as the engine keeps them: one product each.
        _fuse(self.w, self.num_layers)
        if torch.device(device).type == "cpu":
            # The engine's layout on the CPU (layers/column_major.py), whose products are
            # faster at one row (GEMV) and at large batches; a tied head stays shared.
            arena = WeightArena.create()  # the engine's huge pages, where Linux has them
            self.w = {name: column_major(t, arena) if t.dim() == 2 else t
                      for name, t in self.w.items()}
        self.head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        # The engine's few-row products too (layers/batch_invariant_linear.py): faster than the BLAS at
        # up to 16 rows, and the same numbers as the engine's.
        self.plans: dict[str, batch_invariant_linear.RowPlan] = {}
        if torch.device(device).type == "cpu" and dtype == torch.float32:
            by_shape: dict[tuple[int, ...], batch_invariant_linear.RowPlan] = {}
            for name, t in self.w.items():
                if t.dim() == 2 and not name.endswith("embed_tokens.weight"):
                    if tuple(t.shape) not in by_shape:
                        by_shape[tuple(t.shape)] = batch_invariant_linear.plan(t.t())
                    self.plans[name] = by_shape[tuple(t.shape)]
            if "lm_head.weight" not in self.w:  # tied
                self.plans["model.embed_tokens.weight"] = batch_invariant_linear.plan(self.head.t())
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        self.inv_freq = 1.0 / (theta ** (half / self.head_dim))
        self.dtype, self.device = dtype, torch.device(device)
        # The engine's RoPE tables (layers/rotary_embedding.py), for its native rotation on
        # the CPU in float32 (layers/layer_ops.py).
        self.rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.device.type == "cpu" and dtype == torch.float32:
            length = int(config.get("max_position_embeddings") or 2048)
            freqs = torch.arange(length, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            self.rope_tables = (freqs.cos(), freqs.sin())
        self._kv_heads = torch.arange(self.num_kv_heads, device=device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        native = layer_ops.rms_norm(x, weight, self.eps)  # the engine's, on the CPU
        if native is not None:
            return native
        x32 = x.float()
        scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * (x32 * scale).to(x.dtype)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight, bias = self.w[name + ".weight"], self.w.get(name + ".bias")
        plan = self.plans.get(name + ".weight")
        if plan is None:
            return F.linear(x, weight, bias)
        y = batch_invariant_linear.multiply(x.reshape(-1, x.shape[-1]), weight.t(), plan)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y.add_(bias)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, T, 1, D/2] of the RoPE angles at positions [B, T]."""
        angles = positions.float()[:, :, None, None] * self.inv_freq
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, D] rotated by the angles of _angles (halves rotated, as in Qwen and
        Llama)."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def cache_bytes(self, rows: int, capacity: int) -> int:
        """The size of `new_cache(rows, capacity)` in bytes."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * rows * self.num_kv_heads * capacity * self.head_dim * element

    def new_cache(self, rows: int, capacity: int) -> list[torch.Tensor]:
        """A zeroed KV cache of `rows` sequences of up to `capacity` tokens (for `forward`)."""
        return [torch.zeros(rows, self.num_kv_heads, capacity, self.head_dim, dtype=self.dtype,
                            device=self.device) for _ in range(2 * self.num_layers)]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: list[torch.Tensor],
                rows: torch.Tensor | None, mask: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Runs tokens [B, T] at positions [B, T] for cache rows `rows` (None: rows 0..B-1,
        read through views instead of a gathered copy); returns the last position's logits
        [B, vocab], written into `out` (float32 [B, vocab]) when given. With `mask` None the T
        tokens attend causally to each other only (a prefill from position 0); else mask
        [B, 1, T, L] selects cache slots. Side effect: the tokens' keys and values are written
        to the cache at their positions."""
        b = tokens.shape[0]
        first_rows = rows is None
        if first_rows:
            rows = torch.arange(b, device=self.device)
        x = F.embedding(tokens, self.w["model.embed_tokens.weight"])
        tables = self.rope_tables
        if tables is not None and int(positions.max()) < tables[0].shape[0]:
            step = _Step(positions, positions.reshape(-1).long(), None, None, cache, rows, mask,
                         first_rows)
        else:
            cos, sin = self._angles(positions)  # once per pass, not per layer
            step = _Step(positions, None, cos, sin, cache, rows, mask, first_rows)
        delta: torch.Tensor | None = None
        for i in range(self.num_layers):
            x, delta = self._layer(i, x, delta, step)
        assert delta is not None
        return self._head((x + delta)[:, -1], out)

    def _layer(self, i: int, x: torch.Tensor, delta: torch.Tensor | None, step: _Step
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer i: takes the residual stream x [B, T, hidden] and the previous
        layer's output not yet added to it (None before the first layer); returns both for
        the next layer, as the engine's layers carry them."""
        p = f"model.layers.{i}."
        x, h = self._add_norm(x, delta, p + "input_layernorm.weight")
        q, k, v = self._qkv(h, p)
        q, k = self._rope(q, k, step)
        attn = self._attend(i, q, k, v, step)
        b, t = h.shape[:2]
        o = self._linear(attn.transpose(1, 2).reshape(b, t, -1), p + "self_attn.o_proj")
        x, h = self._add_norm(x, o, p + "post_attention_layernorm.weight")
        gate_up = self._linear(h, p + "mlp.gate_up_proj")
        return x, self._linear(self._act(gate_up), p + "mlp.down_proj")

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its RMS norm by weight `weight`); (x, norm(x)) when delta is None."""
        if delta is not None:
            # The engine's fused add and norm, on the CPU.
            native = layer_ops.rms_norm(delta, self.w[weight], self.eps, x)
            if native is not None:
                return native[1], native[0]
            x = x + delta
        return x, self._norm(x, self.w[weight])

    def _qkv(self, h: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [B, T, H, D] of the normed h [B, T, hidden] (per-head
        norms applied for Qwen3)."""
        b, t = h.shape[:2]
        qkv = self._linear(h, p + "self_attn.qkv_proj")
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = (y.reshape(b, t, -1, self.head_dim)
                   for y in qkv.split([q_size, kv_size, kv_size], dim=-1))
        if self.qk_norm:
            q = self._norm(q, self.w[p + "self_attn.q_norm.weight"])
            k = self._norm(k, self.w[p + "self_attn.k_norm.weight"])
        return q, k, v

    def _rope(self, q: torch.Tensor, k: torch.Tensor, step: _Step
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [B, T, H, D] rotated at the step's positions: natively from the tables
        when the step has flat positions, else by _angles."""
        b, t, _, d = q.shape
        if step.flat_positions is not None:
            assert self.rope_tables is not None
            native = layer_ops.rotary_neox(step.flat_positions, q.reshape(b * t, -1),
                                           k.reshape(b * t, -1), *self.rope_tables, d)
            if native is not None:
                return native[0].view(q.shape), native[1].view(k.shape)
        cos, sin = (step.cos, step.sin) if step.cos is not None else self._angles(step.positions)
        assert sin is not None
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: _Step
                ) -> torch.Tensor:
        """Writes layer i's keys and values [B, T, Hkv, D] to its cache at the step's
        positions, then returns the attention of q [B, T, H, D] as [B, H, T, D] (see
        forward's mask)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k_cache, v_cache = step.cache[2 * i], step.cache[2 * i + 1]  # [N, Hkv, L, D]
        where = (step.rows[:, None, None], self._kv_heads[None, :, None],
                 step.positions[:, None, :])
        k_cache[where] = k
        v_cache[where] = v
        if step.mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        length = step.mask.shape[-1]
        if step.first_rows:
            keys, values = k_cache[: q.shape[0], :, :length], v_cache[: q.shape[0], :, :length]
        else:
            keys, values = k_cache[step.rows, :, :length], v_cache[step.rows, :, :length]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask,
                                              enable_gqa=True)

    @staticmethod
    def _act(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused [..., 2 * I] gate/up output."""
        native = layer_ops.silu_and_mul(gate_up)  # the engine's, on the CPU
        if native is not None:
            return native
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _head(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Logits [B, vocab] of the last positions' residual stream x [B, hidden] (final norm,
        then the LM head), written into `out` when given."""
        last = self._norm(x, self.w["model.norm.weight"])
        head_plan = self.plans.get("lm_head.weight", self.plans.get("model.embed_tokens.weight"))
        if head_plan is not None:
            return batch_invariant_linear.multiply(last, self.head.t(), head_plan, out)
        if out is not None and last.dtype == torch.float32:
            return torch.matmul(last, self.head.t(), out=out)
        logits = F.linear(last, self.head).float()
        return logits if out is None else out.copy_(logits)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy token of every row of float32 logits [B, vocab]."""
        if logits.device.type != "cpu":
            return logits.argmax(-1)
        tokens = torch.empty(logits.shape[0], dtype=torch.int64)
        ops.masked_argmax(logits.numpy(), None, None, tokens.numpy())
        return tokens

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of `max_new_tokens` tokens (no stop tokens) of every prompt."""
        n = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        capacity = int(lengths.max()) + max_new_tokens
        cache = self.new_cache(n, capacity)
        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        for group in _prefill_groups(prompts):
            # Prompts of one length prefill together, as the engine batches its prefills.
            ids = torch.tensor([prompts[r] for r in group], device=self.device)
            positions = torch.arange(ids.shape[1], device=self.device)[None].expand_as(ids)
            rows = torch.tensor(group, device=self.device)
            tokens[rows] = self._argmax(self.forward(ids, positions, cache, rows, None))
        steps = [tokens]
        slots = torch.arange(capacity, device=self.device)
        logits = torch.empty(n, self.head.shape[0], dtype=torch.float32, device=self.device)
        for step in range(max_new_tokens - 1):
            positions = lengths + step  # where this step's input token goes
            length = int(positions.max()) + 1
            mask = (slots[None, :length] <= positions[:, None])[:, None, None, :]
            self.forward(tokens[:, None], positions[:, None], cache, None, mask, out=logits)
            tokens = self._argmax(logits)
            steps.append(tokens)
        return torch.stack(steps, dim=1).tolist()


# Tokens one prefill forward may hold: bounds its activations while keeping batches of short
# prompts whole.
_PREFILL_TOKENS = 16384


def _prefill_groups(prompts: list[list[int]]) -> list[list[int]]:
    """Indices of `prompts` in groups of one length, each group at most _PREFILL_TOKENS tokens
    (or one prompt), in order of first appearance."""
    by_length: dict[int, list[int]] = {}
    for r, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(r)
    groups: list[list[int]] = []
    for length, rows in by_length.items():
        per_group = max(1, _PREFILL_TOKENS // max(length, 1))
        groups += [rows[i : i + per_group] for i in range(0, len(rows), per_group)]
    return groups


@dataclass
class _Step:
    """What every layer of one forward pass shares."""

    positions: torch.Tensor  # [B, T]
    # [B * T] int64 for the native RoPE from the tables; else None and the angles are given.
    flat_positions: torch.Tensor | None
    cos: torch.Tensor | None  # RoPE angles, [B, T, 1, D/2]
    sin: torch.Tensor | None
    cache: list[torch.Tensor]
    rows: torch.Tensor  # cache rows of the batch
    mask: torch.Tensor | None
    first_rows: bool  # rows are 0..B-1 (the cache is read through views)


def _fuse(w: dict[str, torch.Tensor], num_layers: int) -> None:
    """Replaces each layer's q/k/v (weights and biases) by one qkv_proj tensor and its
    gate/up by one gate_up_proj, stacked by output rows in the engine's order."""
    parts = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
             ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for fused, names in parts:
            for kind in ("weight", "bias"):
                keys = [f"{p}{name}.{kind}" for name in names]
                if all(key in w for key in keys):
                    w[f"{p}{fused}.{kind}"] = torch.cat([w.pop(key) for key in keys])
