"""Tests for vllm/model_executor/model_loader/demo_scripted.py: demo-think writes its script."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm.model_executor.model_loader import demo_scripted
from vllm.model_executor.model_loader.demo_scripted import SCRIPT
from vllm.transformers_utils.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_scripted.build(tmp_path_factory.mktemp("cache"))


def test_weights_map_each_scripted_token_to_the_next(think_dir: Path) -> None:
    weights = load_file(str(think_dir / "model.safetensors"))
    tok = get_tokenizer(think_dir)
    ids = [tok.convert_tokens_to_ids(tok.tokenize(p))[0] for p in SCRIPT]
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    # The layers add nothing; the final norm scales a unit vector by sqrt(hidden).
    hidden = embed[ids] * embed.shape[1] ** 0.5
    logits = hidden @ head.T
    assert logits[:-1].argmax(dim=1).tolist() == ids[1:]
    assert torch.all(logits[:-1].max(dim=1).values > 30)
    assert torch.all(logits[-1] == 0)  # after the script: uniform
    assert not weights["model.layers.0.self_attn.o_proj.weight"].any()


def test_chat_template_writes_an_empty_thinking_block_when_thinking_is_off(
    think_dir: Path,
) -> None:
    tok = get_tokenizer(think_dir)
    messages = [{"role": "user", "content": "hi"}]
    on = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"


def test_resolve_only_knows_its_own_name(tmp_path: Path) -> None:
    assert demo_scripted.resolve("demo-tiny", tmp_path) is None
    assert list(tmp_path.iterdir()) == []
