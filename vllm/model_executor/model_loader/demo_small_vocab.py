"""Demo models with a reduced Qwen vocabulary, for overhead-bound benchmarks on a CPU.

With Qwen's full vocabulary the LM head dominates a tiny model's step on a CPU, so engine
overheads (scheduling, bitmasks, detokenizing) hide behind it. These models keep a tiny Qwen3
body but only the first `num_base_tokens` BPE ranks of Qwen's vocabulary plus its 26 added
tokens, which makes a step cheap enough that the engine's CPU time matters, as on a GPU.
"demo-small-vocab-deep" keeps the same vocabulary on a wider, deeper body, so its decoder
layers dominate a step (for pipeline-parallel benchmarks). Built once and cached next to the
other demo models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.model_executor.model_loader.demo_model import (
    DEMO_MODELS,
    EOS_TOKEN,
    INIT_STD,
    NORM_NOISE,
    PAD_TOKEN,
    DemoModelSpec,
    build_cached,
    generation_config,
    hf_config,
    model_dir,
    tokenizer_config,
    weight_shapes,
    write_json,
)
from vllm.model_executor.model_loader.demo_tilt import tilt
from vllm.transformers_utils.qwen_vocab import ADDED_TOKENS, build_tokenizer, load_ranks


@dataclass(frozen=True)
class SmallVocabSpec:
    """A demo Qwen3 body plus how many of Qwen's BPE ranks its vocabulary keeps."""

    body: DemoModelSpec
    num_base_tokens: int
    # Embedding rows; at least num_base_tokens + the added tokens (padded, like Qwen's).
    vocab_size: int

    @property
    def compact_json(self) -> bool:
        """Whether JSON is served without optional whitespace by default (the body's say)."""
        return self.body.compact_json

    @property
    def eos_token_id(self) -> int:
        """Id of `<|im_end|>`."""
        return self.num_base_tokens + _added_index(EOS_TOKEN)

    @property
    def pad_token_id(self) -> int:
        """Id of `<|endoftext|>`."""
        return self.num_base_tokens + _added_index(PAD_TOKEN)


# A body whose decoder layers, not its LM head, dominate a step: the layers hold ~25M
# parameters against the head's ~4M, so a pipeline split into stages by layers is balanced.
DEEP_BODY = DemoModelSpec(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    head_dim=64,
    num_key_value_heads=4,
    intermediate_size=1536,
)

SMALL_VOCAB_MODELS: dict[str, SmallVocabSpec] = {
    "demo-small-vocab": SmallVocabSpec(
        body=DEMO_MODELS["demo-tiny"], num_base_tokens=8192, vocab_size=8256
    ),
    "demo-small-vocab-deep": SmallVocabSpec(body=DEEP_BODY, num_base_tokens=8192, vocab_size=8256),
}


def _added_index(content: str) -> int:
    return [c for c, _ in ADDED_TOKENS].index(content)


def build_small_vocab_model(
    name: str = "demo-small-vocab", cache_root: Path | None = None
) -> Path:
    """Return the directory of reduced-vocabulary demo model `name`, building it on first use.

    Safe when several processes build at once (the first atomic rename wins). Raises
    ValueError for an unknown name, OSError if the cache cannot be written.
    """
    spec = SMALL_VOCAB_MODELS.get(name)
    if spec is None:
        known = ", ".join(SMALL_VOCAB_MODELS)
        raise ValueError(f"model: {name!r} is not a reduced-vocabulary demo model (known: {known})")
    return build_cached(model_dir(name, cache_root), lambda tmp: write_model(tmp, spec))


def resolve(model: str | None, cache_root: Path | None = None) -> Path | None:
    """Return the built directory if `model` names a reduced-vocabulary demo model, else None."""
    if model in SMALL_VOCAB_MODELS:
        return build_small_vocab_model(model, cache_root)
    return None


def small_hf_config(spec: SmallVocabSpec) -> dict:
    """Return `config.json` contents: the body's Qwen3 config with the reduced vocabulary."""
    config = hf_config(spec.body)
    config.update(
        vocab_size=spec.vocab_size,
        eos_token_id=spec.eos_token_id,
        pad_token_id=spec.pad_token_id,
    )
    return config


def small_tokenizer_config(spec: SmallVocabSpec) -> dict:
    """Return `tokenizer_config.json` contents with the added tokens at their reduced ids."""
    config = tokenizer_config()
    config["added_tokens_decoder"] = {
        str(spec.num_base_tokens + i): entry
        for i, entry in enumerate(config["added_tokens_decoder"].values())
    }
    return config


def random_weights(spec: SmallVocabSpec) -> dict[str, torch.Tensor]:
    """Return seeded random float32 weights (N(0, 0.02) matrices, norms near 1), tilted
    toward the closing characters the reduced vocabulary has (demo_tilt.py)."""
    shapes = weight_shapes(spec.body)
    shapes["model.embed_tokens.weight"] = (spec.vocab_size, spec.body.hidden_size)
    gen = torch.Generator().manual_seed(spec.body.seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        weights[name] = 1.0 + NORM_NOISE * noise if len(shape) == 1 else INIT_STD * noise
    tilt(weights, load_ranks(), spec.num_base_tokens, spec.body.num_hidden_layers)
    return weights


def write_model(
    path: Path,
    spec: SmallVocabSpec,
    make_weights: Callable[[SmallVocabSpec, Path], dict[str, torch.Tensor]] | None = None,
) -> None:
    """Write every file of a reduced-vocabulary model into the existing directory `path`.

    The weights are random, or `make_weights(spec, path)` (called once the tokenizer is
    written); with an `lm_head.weight` among them the head is not tied to the embedding.
    Raises ValueError if the spec's vocabulary does not fit, OSError on write failures.
    """
    from safetensors.torch import save_file

    needed = spec.num_base_tokens + len(ADDED_TOKENS)
    if spec.vocab_size < needed:
        raise ValueError(f"vocab_size: {spec.vocab_size} is below the {needed} tokens it must hold")
    ranks = {tok: rank for tok, rank in load_ranks().items() if rank < spec.num_base_tokens}
    if len(ranks) != spec.num_base_tokens:
        raise ValueError(f"num_base_tokens: Qwen's vocabulary has only {len(ranks)} ranks")
    (path / "tokenizer.json").write_text(build_tokenizer(ranks).to_str(pretty=True), "utf-8")
    weights = random_weights(spec) if make_weights is None else make_weights(spec, path)
    config = small_hf_config(spec)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    write_json(path / "config.json", config)
    write_json(
        path / "generation_config.json", generation_config(spec.eos_token_id, spec.pad_token_id)
    )
    write_json(path / "tokenizer_config.json", small_tokenizer_config(spec))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
