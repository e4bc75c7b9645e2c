"""The demo model: a small Qwen3 with Qwen's real vocabulary and seeded random weights.

No model hub is reachable, so `build_demo_model` writes a complete Hugging Face model
directory (config, generation config, tokenizer, chat template, safetensors) once and caches
it under `<cache_root>/demo-models/<name>-v1`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.model_executor.model_loader.demo_tilt import tilt
from vllm.transformers_utils.qwen_vocab import (
    ADDED_TOKENS,
    NUM_BASE_TOKENS,
    load_ranks,
    write_tokenizer_json,
)

# Bump when the files a build writes change, so stale caches are not reused.
BUILD_VERSION = "v3-tilt"
DEFAULT_MODEL = "demo"

VOCAB_SIZE = 151_936
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 151_645
PAD_TOKEN_ID = 151_643
MAX_POSITIONS = 4096
INIT_STD = 0.02
NORM_NOISE = 0.01


@dataclass(frozen=True)
class DemoModelSpec:
    """Sizes of one demo Qwen3 model."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    num_key_value_heads: int
    intermediate_size: int
    seed: int = 0
    # Serve JSON without optional whitespace unless the user says otherwise: random
    # weights would spend their tokens on it (docs/architecture.md §7).
    compact_json: bool = True


DEMO_MODELS: dict[str, DemoModelSpec] = {
    "demo": DemoModelSpec(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=64,
        num_key_value_heads=2,
        intermediate_size=768,
    ),
    "demo-tiny": DemoModelSpec(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=2,
        intermediate_size=128,
    ),
}

# ChatML as Qwen writes it (no thinking block, no default system prompt), with Qwen's
# <tools>/<tool_call>/<tool_response> conventions for function calling.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- text(messages[0]['content']) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' -}}"
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' + text(messages[0]['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) -}}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- if not loop.first or text(message['content']) -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}"
    "{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    # Qwen3's switch: an empty thinking block tells the model to answer at once.
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def default_cache_root() -> Path:
    """Return `$VLLM_CACHE_ROOT`, or `~/.cache/vllm` when it is unset or empty."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    return Path(root).expanduser() if root else Path("~/.cache/vllm").expanduser()


def model_dir(name: str, cache_root: Path | None = None) -> Path:
    """Return where demo model `name` is (or would be) cached; builds nothing."""
    root = default_cache_root() if cache_root is None else Path(cache_root).expanduser()
    return root / "demo-models" / f"{name}-{BUILD_VERSION}"


def build_demo_model(name: str = DEFAULT_MODEL, cache_root: Path | None = None) -> Path:
    """Return the directory of demo model `name`, building and caching it on first use.

    Safe when several processes build at once: each builds into its own temporary
    directory and the first atomic rename wins. Raises ValueError for an unknown name,
    OSError if the cache cannot be written.
    """
    spec = DEMO_MODELS.get(name)
    if spec is None:
        raise ValueError(f"model: {name!r} is not a demo model (known: {', '.join(DEMO_MODELS)})")
    return build_cached(model_dir(name, cache_root), lambda tmp: _write_model(tmp, spec))


def build_cached(final: Path, write: Callable[[Path], None]) -> Path:
    """Return `final`, first filling it by `write` unless it already holds a `config.json`.

    `write` fills a fresh temporary sibling directory, which is then renamed to `final`, so
    several processes may build at once: the first rename wins and the others discard theirs.
    Nothing is left behind if `write` raises. Raises what `write` raises, OSError if the
    cache cannot be written.
    """
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        write(tmp)
        try:
            os.rename(tmp, final)
        except OSError as exc:
            # Another process finished first; its directory is as good as ours.
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def hf_config(spec: DemoModelSpec) -> dict:
    """Return the `config.json` contents of a demo model with sizes `spec`."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1_000_000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
    }


def tokenizer_config() -> dict:
    """Return the demo model's `tokenizer_config.json` contents (Qwen3's, with our template)."""
    decoder = {
        str(NUM_BASE_TOKENS + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    extra = [c for c, special in ADDED_TOKENS if special and c != PAD_TOKEN]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": extra,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def weight_shapes(spec: DemoModelSpec) -> dict[str, tuple[int, ...]]:
    """Return HF Qwen3ForCausalLM's parameter names and shapes (tied: no lm_head.weight)."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB_SIZE, h)}
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    return shapes


def random_weights(spec: DemoModelSpec) -> dict[str, torch.Tensor]:
    """Return seeded random float32 weights (N(0, 0.02) matrices, norms near 1), tilted
    toward closing characters (demo_tilt.py)."""
    gen = torch.Generator().manual_seed(spec.seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(spec).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) == 1:
            weights[name] = 1.0 + NORM_NOISE * noise
        else:
            weights[name] = INIT_STD * noise
    tilt(weights, load_ranks(), NUM_BASE_TOKENS, spec.num_hidden_layers)
    return weights


def _write_model(path: Path, spec: DemoModelSpec) -> None:
    """Write every file of a demo model into the existing directory `path`."""
    from safetensors.torch import save_file

    write_json(path / "config.json", hf_config(spec))
    write_json(path / "generation_config.json", generation_config(EOS_TOKEN_ID, PAD_TOKEN_ID))
    write_json(path / "tokenizer_config.json", tokenizer_config())
    _write_tokenizer(path)
    save_file(random_weights(spec), str(path / "model.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(path: Path) -> None:
    """Write tokenizer.json, copying it from a sibling demo model of this version if one exists."""
    target = path / "tokenizer.json"
    for other in DEMO_MODELS:
        source = path.parent / f"{other}-{BUILD_VERSION}" / "tokenizer.json"
        if source.is_file():
            shutil.copyfile(source, target)
            return
    write_tokenizer_json(target)


def generation_config(eos_token_id: int, pad_token_id: int) -> dict:
    """Return `generation_config.json` contents: greedy, stopping at EOS or at padding."""
    return {
        "bos_token_id": None,
        "eos_token_id": [eos_token_id, pad_token_id],
        "pad_token_id": pad_token_id,
        "do_sample": False,
    }


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` as indented UTF-8 JSON. Raises OSError on write failures."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
