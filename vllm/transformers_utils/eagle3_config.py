"""An EAGLE-3 draft head's configuration, read from either layout people ship and checked
against the target model (docs/architecture.md §11).

Two layouts:
- *speculators* (`config.json` with `speculators_config`, written by the `speculators`
  package): the decoder layer's fields under `transformer_layer_config`, the head's own
  switches (`norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`) at the top,
  tensors named `layers.N.*`.
- *original EAGLE-3* (`architectures: ["LlamaForCausalLMEagle3"]`): Llama fields at the top,
  the one decoder layer's tensors named `midlayer.*`, often no token embedding (the target's
  is used).

Both hold `fc` (the concatenated auxiliary hidden states of the target to one hidden state),
the first decoder layer's 2 x hidden wide q/k/v input, a final norm, and an LM head over a
draft vocabulary of `draft_vocab_size` tokens whose target ids are `d + d2t[d]`. Every
problem is a ValueError naming the key or the file, raised before any process starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm.transformers_utils.eagle3_weights import (
    FLAG,
    TensorRef,
    list_tensors,
    read_tensor,
)

# Decoder-layer families a head may use: Qwen3's adds per-head q/k norms.
_MODEL_TYPES = ("llama", "qwen3")
_ROPE_TYPES = ("default", "linear", "llama3")
# Training-only tensors the speculators package may leave in a checkpoint.
_UNUSED = ("verifier_lm_head.weight", "verifier_norm.weight")


@dataclass(frozen=True)
class Eagle3HeadConfig:
    """What building and loading an EAGLE-3 head needs, checked against its target."""

    model_dir: Path
    layout: str  # "speculators" or "eagle3"
    model_type: str  # "llama" or "qwen3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: dict[str, Any]
    attention_bias: bool
    mlp_bias: bool
    vocab_size: int  # the target's
    draft_vocab_size: int
    # Target layers whose input residual stream feeds fc (num_layers: the last one's output).
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # Our tensor name -> where it lies in the checkpoint.
    tensors: dict[str, TensorRef] = field(default_factory=dict, repr=False)

    @property
    def has_embedding(self) -> bool:
        """Whether the head has its own token embedding (else it shares the target's)."""
        return "embed_tokens.weight" in self.tensors

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Our name -> shape of every tensor the head needs (d2t, t2d and the embedding
        optional, see read_eagle3_head)."""
        h, n_aux = self.hidden_size, len(self.aux_layer_ids)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "fc.weight": (h, n_aux * h), "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
        }
        if self.norm_before_fc:
            shapes["input_norm.weight"] = (n_aux * h,)
        if self.fc_norm:
            shapes.update({f"fc_norm.{j}.weight": (h,) for j in range(n_aux)})
        for i in range(self.num_layers):
            p = f"layers.{i}."
            width = 2 * h if i == 0 else h
            shapes.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, width),
                p + "self_attn.k_proj.weight": (kv, width),
                p + "self_attn.v_proj.weight": (kv, width), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                p + "mlp.up_proj.weight": (self.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, self.intermediate_size),
            })
            if i == 0:
                shapes[p + "hidden_norm.weight"] = (h,)
            if self.attention_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,),
                               p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,),
                               p + "self_attn.o_proj.bias": (h,)})
            if self.mlp_bias:
                shapes.update({p + "mlp.gate_proj.bias": (self.intermediate_size,),
                               p + "mlp.up_proj.bias": (self.intermediate_size,),
                               p + "mlp.down_proj.bias": (h,)})
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (self.head_dim,),
                               p + "self_attn.k_norm.weight": (self.head_dim,)})
        return shapes

    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab_size] int64: the target id of each draft id (identity without d2t).
        Raises ValueError when d2t maps a draft id outside the target's vocabulary."""
        ids = torch.arange(self.draft_vocab_size, dtype=torch.int64)
        ref = self.tensors.get("d2t")
        if ref is None:
            return ids
        target = ids + read_tensor(ref).to(torch.int64)
        bad = (target < 0) | (target >= self.vocab_size)
        if bool(bad.any()):
            d = int(bad.nonzero()[0, 0])
            raise ValueError(f"{FLAG}: d2t maps draft id {d} to {int(target[d])}, outside the "
                             f"target's vocabulary of {self.vocab_size} tokens")
        return target


def _read_json(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{FLAG}: {model_dir} has no config.json")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{FLAG}: malformed config.json in {model_dir}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{FLAG}: config.json in {model_dir} is not a JSON object")
    return data


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{FLAG}: config.json {where}{key} must be a positive integer, got "
                         f"{value!r}")
    return value


def _flag(cfg: dict[str, Any], key: str) -> bool:
    value = cfg.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{FLAG}: config.json {key} must be true or false, got {value!r}")
    return value


def _aux_layer_ids(top: dict[str, Any], target_layers: int) -> tuple[int, ...]:
    """The head's auxiliary layers, or upstream's default (2, L // 2, L - 3)."""
    eagle_config = top.get("eagle_config")
    ids = top.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    key = "eagle_aux_hidden_state_layer_ids"
    if ids is None:
        ids = [2, target_layers // 2, target_layers - 3]
        if min(ids) < 0 or max(ids) > target_layers:
            raise ValueError(
                f"{FLAG}: config.json has no {key}, and the default {ids} does not fit a "
                f"target of {target_layers} layers; give the layers the head was trained on")
        return tuple(ids)
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ValueError(f"{FLAG}: config.json {key} must be a non-empty list of layer "
                         f"indices, got {ids!r}")
    if min(ids) < 0 or max(ids) > target_layers:
        raise ValueError(f"{FLAG}: config.json {key} {ids} must lie in [0, {target_layers}] "
                         f"(the target has {target_layers} layers)")
    return tuple(ids)


def _layer_fields(top: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    """(layout, the decoder layer's config, where its keys live in config.json)."""
    if "speculators_config" in top:
        kind = top.get("speculators_model_type")
        if kind != "eagle3":
            raise ValueError(
                f"{FLAG}: config.json speculators_model_type {kind!r} is not supported; only "
                "'eagle3' heads are")
        layer = top.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{FLAG}: config.json transformer_layer_config must be an object")
        return "speculators", layer, "transformer_layer_config."
    archs = top.get("architectures") or []
    if not any("Eagle3" in str(a) for a in archs):
        raise ValueError(
            f"{FLAG}: config.json is neither a speculators head (speculators_config) nor an "
            f"EAGLE-3 head (architectures {archs!r}; expected LlamaForCausalLMEagle3)")
    return "eagle3", top, ""


def _check_target(top: dict[str, Any], layer: dict[str, Any], where: str, target: Any) -> None:
    """Raises ValueError when the head was made for another model than `target`."""
    hidden = _int(layer, "hidden_size", where)
    if hidden != target.hidden_size:
        raise ValueError(f"{FLAG}: config.json {where}hidden_size is {hidden}, the target's "
                         f"{target.hidden_size}; the head must be trained for this target")
    target_hidden = top.get("target_hidden_size")
    if target_hidden is not None and target_hidden != target.hidden_size:
        raise ValueError(f"{FLAG}: config.json target_hidden_size is {target_hidden!r}, the "
                         f"target's hidden_size {target.hidden_size}")
    vocab = _int(layer, "vocab_size", where)
    if vocab != target.vocab_size:
        raise ValueError(f"{FLAG}: config.json {where}vocab_size is {vocab}, the target's "
                         f"{target.vocab_size}; the head must share the target's vocabulary")
    verifier = (top.get("speculators_config") or {}).get("verifier") or {}
    made_for = verifier.get("architectures") if isinstance(verifier, dict) else None
    ours = list(getattr(target, "architectures", None) or [])
    if made_for and ours and not set(made_for) & set(ours):
        raise ValueError(f"{FLAG}: config.json speculators_config.verifier.architectures "
                         f"{made_for} does not include the target's {ours}")


def _canonical(name: str) -> str:
    """Our name for a checkpoint tensor name of either layout."""
    name = name.removeprefix("model.")
    if name.startswith("midlayer."):
        name = "layers.0." + name.removeprefix("midlayer.")
    return name


def read_eagle3_head(model_dir: str | Path, target: Any) -> Eagle3HeadConfig:
    """Reads and checks the EAGLE-3 head in `model_dir` for the target whose Hugging Face
    config is `target`. Reads config.json, the weight files' headers and d2t (small).
    Raises ValueError naming the key or file at fault: a missing directory or config, another
    layout, a hidden size, vocabulary or architecture that is not the target's, auxiliary
    layers outside the target, a tensor missing (d2t with a reduced vocabulary), of the wrong
    shape, unknown, or unreadable."""
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise ValueError(f"{FLAG}: {str(model_dir)!r} is not a directory (an EAGLE-3 head is "
                         "loaded from a local directory)")
    top = _read_json(model_dir)
    layout, layer, where = _layer_fields(top)
    _check_target(top, layer, where, target)
    model_type = layer.get("model_type", "llama")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"{FLAG}: config.json {where}model_type {model_type!r} is not "
                         f"supported; supported: {', '.join(_MODEL_TYPES)}")
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{FLAG}: config.json {where}hidden_act {layer['hidden_act']!r} is "
                         "not supported (only 'silu')")
    if (layer.get("sliding_window") and layer.get("use_sliding_window", True) is not False
            and "sliding_attention" in (layer.get("layer_types") or ["sliding_attention"])):
        raise ValueError(f"{FLAG}: config.json {where}sliding_window: heads with sliding-"
                         "window attention are not supported")
    from vllm.model_executor.layers.rotary_embedding import rope_parameters

    rope = rope_parameters(_Fields(layer))
    if rope["rope_type"] not in _ROPE_TYPES:
        raise ValueError(f"{FLAG}: config.json {where}rope type {rope['rope_type']!r} is not "
                         f"supported; supported: {', '.join(_ROPE_TYPES)}")
    hidden = layer["hidden_size"]
    num_heads = _int(layer, "num_attention_heads", where)
    head_dim = layer.get("head_dim") or hidden // num_heads
    vocab = layer["vocab_size"]
    draft_vocab = _int(top, "draft_vocab_size", "", default=vocab)
    if draft_vocab > vocab:
        raise ValueError(f"{FLAG}: config.json draft_vocab_size {draft_vocab} exceeds the "
                         f"target's vocabulary ({vocab})")
    config = Eagle3HeadConfig(
        model_dir=model_dir, layout=layout, model_type=model_type, hidden_size=hidden,
        num_layers=_int(layer, "num_hidden_layers", where, default=1),
        num_heads=num_heads,
        num_kv_heads=_int(layer, "num_key_value_heads", where, default=num_heads),
        head_dim=int(head_dim), intermediate_size=_int(layer, "intermediate_size", where),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope=rope,
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias", False)), vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=_aux_layer_ids(top, target.num_hidden_layers),
        norm_before_residual=_flag(top, "norm_before_residual"),
        norm_before_fc=_flag(top, "norm_before_fc"), fc_norm=_flag(top, "fc_norm"),
        norm_output=_flag(top, "norm_output"),
    )
    tensors = _match_tensors(config, list_tensors(model_dir))
    object.__setattr__(config, "tensors", tensors)
    config.draft_to_target()  # reads d2t: a bad map is a startup error too
    return config


def _match_tensors(config: Eagle3HeadConfig, found: dict[str, TensorRef]) -> dict[str, TensorRef]:
    """Our name -> checkpoint tensor, every one checked. Raises ValueError naming a tensor
    that is missing, misshapen or unknown."""
    expected = config.expected_shapes()
    optional = {"embed_tokens.weight": (config.vocab_size, config.hidden_size),
                "d2t": (config.draft_vocab_size,), "t2d": (config.vocab_size,)}
    tensors: dict[str, TensorRef] = {}
    for name, ref in found.items():
        ours = _canonical(name)
        if ours in _UNUSED or ours.endswith("rotary_emb.inv_freq"):
            continue
        shape = expected.get(ours, optional.get(ours))
        if shape is None:
            raise ValueError(f"{FLAG}: tensor {name!r} in {ref.path.name} has no place in an "
                             f"EAGLE-3 head of this config")
        if ref.shape != shape:
            raise ValueError(f"{FLAG}: tensor {name!r} in {ref.path.name} has shape "
                             f"{list(ref.shape)}, expected {list(shape)} from config.json")
        tensors[ours] = ref
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{FLAG}: the head's weights lack tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if config.draft_vocab_size < config.vocab_size and "d2t" not in tensors:
        raise ValueError(f"{FLAG}: the head drafts over {config.draft_vocab_size} of the "
                         f"target's {config.vocab_size} tokens but its weights lack 'd2t' (the "
                         "draft id -> target id offsets)")
    return tensors


class _Fields:
    """A config dict read through attributes (rope_parameters reads a config object)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getattr__(self, name: str) -> Any:
        return self._data.get(name)
