"""A demo model that follows a script, so reasoning and tool calling can be tested end to end.

A random demo model never writes `</think>` or `<tool_call>`; "demo-think" does, on cue:
after a newline it writes `<think>OK, the user wants an answer.</think>\\n\\n<tool_call>`
and from then on tokens at random (under greedy sampling, the lowest id a constraint
allows). Its weights are built, not trained: the embedding of each scripted token is a unit
vector of its own hidden dimension and the LM head row of its successor points along that
vector, so the successor's logit is 40 and every other logit 0; every token outside the
script embeds to zero, which gives uniform logits. The decoder layers add nothing (their
output projections are zero). Vocabulary: demo-small-vocab's, so the model is a few MB.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm.model_executor.model_loader.demo_model import build_cached, model_dir, weight_shapes
from vllm.model_executor.model_loader.demo_small_vocab import (
    SMALL_VOCAB_MODELS,
    SmallVocabSpec,
    write_model,
)

NAME = "demo-think"
# The reduced-vocabulary model whose vocabulary and body demo-think takes.
BODY = "demo-small-vocab"
# Each piece is one token of the vocabulary, and no piece but the last appears twice.
SCRIPT = (
    "\n", "<think>", "OK", ",", " the", " user", " wants", " an", " answer", ".",
    "</think>", "\n\n", "<tool_call>",
)
# The successor's logit (after the final norm the hidden state has length sqrt(hidden)).
_LOGIT = 40.0


def build(cache_root: Path | None = None) -> Path:
    """Return the directory of demo-think, building it on first use.

    Raises ValueError when a piece of SCRIPT is not one token, OSError if the cache cannot
    be written.
    """
    spec = SMALL_VOCAB_MODELS[BODY]
    return build_cached(
        model_dir(NAME, cache_root), lambda tmp: write_model(tmp, spec, scripted_weights)
    )


def resolve(model: str | None, cache_root: Path | None = None) -> Path | None:
    """Return the built directory if `model` is "demo-think", else None."""
    return build(cache_root) if model == NAME else None


def scripted_weights(spec: SmallVocabSpec, path: Path) -> dict[str, torch.Tensor]:
    """The weights of a model that writes SCRIPT (the tokenizer is already in `path`).

    Raises ValueError when a piece of SCRIPT is not one token or the script is longer than
    the hidden size.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = []
    for piece in SCRIPT:
        encoded = tokenizer.encode(piece, add_special_tokens=False).ids
        if len(encoded) != 1:
            raise ValueError(f"demo-think: script piece {piece!r} is not one token ({encoded})")
        ids.append(encoded[0])
    if len(set(ids[:-1])) != len(ids) - 1:
        raise ValueError("demo-think: a scripted token has two successors")
    hidden = spec.body.hidden_size
    if len(ids) - 1 > hidden:
        raise ValueError(f"demo-think: {len(ids) - 1} scripted tokens exceed hidden size {hidden}")
    shapes = weight_shapes(spec.body)
    shapes["model.embed_tokens.weight"] = (spec.vocab_size, hidden)
    weights = {
        name: torch.ones(shape) if len(shape) == 1 else torch.zeros(shape)
        for name, shape in shapes.items()
    }
    embed = weights["model.embed_tokens.weight"]
    head = torch.zeros(spec.vocab_size, hidden)
    scale = _LOGIT / hidden**0.5
    for slot, (token, successor) in enumerate(zip(ids, ids[1:])):
        embed[token, slot] = 1.0
        head[successor, slot] = scale
    weights["lm_head.weight"] = head
    return weights
