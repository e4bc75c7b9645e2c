"""Tests for vllm/model_executor/model_loader/demo_tilt.py: the demo's closing-token tilt."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from vllm.model_executor.model_loader.demo_model import (
    DEMO_MODELS,
    EOS_TOKEN_ID,
    build_demo_model,
    random_weights,
)
from vllm.model_executor.model_loader.demo_tilt import (
    BRACKETS,
    CLOSERS,
    QUOTES,
    SEPARATORS,
    closer_ids,
    piece_ids,
)
from vllm.model_executor.model_loader.demos import serves_compact_json
from vllm.transformers_utils.qwen_vocab import load_ranks

SPEC = DEMO_MODELS["demo-tiny"]


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return closer_ids(load_ranks(), 151_643)


def test_closer_ids_are_the_closing_tokens(ids: list[int]) -> None:
    ranks = load_ranks()
    assert {ranks[b'"'], ranks[b"}"], ranks[b"]"], ranks[b'",']} <= set(ids)
    assert len(ids) == len(CLOSERS)  # the full vocabulary has every piece as one token
    # A reduced vocabulary keeps only the closers among its ranks.
    assert closer_ids(ranks, 100) == [i for i in ids if i < 100] != []


def test_constant_channel_is_never_written(ids: list[int]) -> None:
    w = random_weights(SPEC)
    channel = SPEC.hidden_size - 1
    embed = w["model.embed_tokens.weight"]
    ranks = load_ranks()
    quotes, brackets, seps = (piece_ids(p, ranks, 151_643) for p in (QUOTES, BRACKETS, SEPARATORS))
    others = torch.ones(embed.shape[0], dtype=torch.bool)
    others[quotes + brackets + seps] = False
    constant = embed[EOS_TOKEN_ID, channel]
    assert torch.all(embed[others, channel] == constant) and constant > 0
    # Tiers: a quote beats a bracket (text inside a string), which beats a separator.
    assert embed[seps, channel].min() > constant
    assert embed[brackets, channel].min() > embed[seps, channel].max()
    assert embed[quotes, channel].min() > embed[brackets, channel].max()
    assert others[EOS_TOKEN_ID]  # EOS is not tilted
    for layer in range(SPEC.num_hidden_layers):
        p = f"model.layers.{layer}."
        assert not w[p + "self_attn.o_proj.weight"][channel].any()
        assert not w[p + "mlp.down_proj.weight"][channel].any()


def test_closers_dominate_greedy_and_sampled_next_tokens(ids: list[int]) -> None:
    """On arbitrary contexts the checkpoint (read by transformers) puts most of the next
    token's probability on closing tokens and its argmax on one."""
    path = build_demo_model("demo-tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 151_643, (3, 24), generator=gen)
    with torch.no_grad():
        logits = model(tokens).logits
    closer = torch.zeros(logits.shape[-1], dtype=torch.bool)
    closer[ids] = True
    probs = logits.softmax(-1)[..., closer].sum(-1)
    assert probs.min() > 1 - 1 / math.e
    assert closer[logits.argmax(-1)].all()


@pytest.mark.parametrize("model, want", [
    (None, True), ("demo", True), ("demo-tiny", True), ("demo-small-vocab", True),
    ("demo-think", True), ("Qwen/Qwen3-0.6B", False), ("/no/such/dir", False),
])
def test_serves_compact_json(model: str | None, want: bool) -> None:
    assert serves_compact_json(model) is want
